package server

import (
	"net/http"
	"regexp"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics are the server's Prometheus instruments. Counters and the latency
// histogram are updated as requests are served; the gauges (tensors, state
// bytes, per client) are read from the sessions at scrape time.
type metrics struct {
	requests *prometheus.CounterVec
	errors   *prometheus.CounterVec
	bytes    prometheus.Counter
	latency  prometheus.Histogram
	perReq   *prometheus.CounterVec

	tensors, stateBytes, segments, segBytes, sessions *prometheus.Desc
	deviceState, deviceSegments, ipcOpen              *prometheus.Desc
	phaseSeconds                                      *prometheus.Desc
	clientTensors, clientState                        *prometheus.Desc
}

func newMetrics() *metrics {
	return &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "sonard_requests_total",
			Help: "Requests served, by operation."}, []string{"op"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "sonard_request_errors_total",
			Help: "Requests answered with an error, by operation."}, []string{"op"}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{Name: "sonard_bytes_updated_total",
			Help: "Parameter bytes updated or accumulated by step requests."}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "sonard_step_seconds",
			Help:    "Time to validate and apply one step request.",
			Buckets: prometheus.ExponentialBuckets(10e-6, 2, 18)}),
		perReq: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "sonard_client_requests_total",
			Help: "Requests served, by client process."}, []string{"client", "pid"}),
		tensors:        prometheus.NewDesc("sonard_tensors", "Registered tensors.", nil, nil),
		stateBytes:     prometheus.NewDesc("sonard_state_bytes", "Bytes of optimizer state held.", nil, nil),
		segments:       prometheus.NewDesc("sonard_segments", "Attached shared-memory segments.", nil, nil),
		segBytes:       prometheus.NewDesc("sonard_segment_bytes", "Bytes of attached shared memory.", nil, nil),
		sessions:       prometheus.NewDesc("sonard_sessions", "Connected client sessions.", nil, nil),
		deviceState:    prometheus.NewDesc("sonard_device_state_bytes", "Bytes of optimizer state held in GPU memory.", nil, nil),
		deviceSegments: prometheus.NewDesc("sonard_device_segments", "Attached client CUDA allocations.", nil, nil),
		ipcOpen:        prometheus.NewDesc("sonard_ipc_open_bytes", "Bytes of client CUDA allocations open in the IPC cache.", nil, nil),
		phaseSeconds: prometheus.NewDesc("sonard_cpu_update_seconds_total",
			"CPU path: seconds (added over the workers) spent checking client gradient pages, reading gradients "+
				"out of client processes, and in the AdamW arithmetic.", []string{"phase"}, nil),
		clientTensors: prometheus.NewDesc("sonard_client_tensors", "Registered tensors, by client process and backend.", []string{"client", "pid", "backend"}, nil),
		clientState:   prometheus.NewDesc("sonard_client_state_bytes", "Bytes of optimizer state held, by client process and backend.", []string{"client", "pid", "backend"}, nil),
	}
}

func (s *Server) observe(client, op string, err error, start time.Time, bytes int64) {
	s.m.requests.WithLabelValues(op).Inc()
	if err != nil {
		s.m.errors.WithLabelValues(op).Inc()
	}
	// Per client only while it has a session (a bye's own request is not
	// counted): its series goes with the session.
	if ss := s.sessions[client]; ss != nil {
		s.m.perReq.WithLabelValues(client, strconv.Itoa(ss.hello.PID)).Inc()
	}
	if op == "step" && err == nil {
		s.m.latency.Observe(time.Since(start).Seconds())
		s.m.bytes.Add(float64(bytes))
	}
}

// collector exports the gauges read from the server's sessions.
type collector struct{ s *Server }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	m := c.s.m
	for _, d := range []*prometheus.Desc{m.tensors, m.stateBytes, m.segments, m.segBytes, m.sessions, m.deviceState,
		m.deviceSegments, m.ipcOpen, m.phaseSeconds, m.clientTensors, m.clientState} {
		ch <- d
	}
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	m := c.s.m
	st := c.s.stats()
	ch <- prometheus.MustNewConstMetric(m.tensors, prometheus.GaugeValue, float64(st.Tensors))
	ch <- prometheus.MustNewConstMetric(m.stateBytes, prometheus.GaugeValue, float64(st.StateBytes))
	ch <- prometheus.MustNewConstMetric(m.segments, prometheus.GaugeValue, float64(st.Segments))
	ch <- prometheus.MustNewConstMetric(m.segBytes, prometheus.GaugeValue, float64(st.SegmentBytes))
	ch <- prometheus.MustNewConstMetric(m.sessions, prometheus.GaugeValue, float64(st.Sessions))
	ch <- prometheus.MustNewConstMetric(m.deviceState, prometheus.GaugeValue, float64(st.DeviceStateBytes))
	ch <- prometheus.MustNewConstMetric(m.deviceSegments, prometheus.GaugeValue, float64(st.DeviceSegments))
	ch <- prometheus.MustNewConstMetric(m.ipcOpen, prometheus.GaugeValue, float64(st.IPCOpenBytes))
	for phase, v := range map[string]float64{"check": st.CheckSeconds, "read": st.ReadSeconds, "kernel": st.KernelSeconds} {
		ch <- prometheus.MustNewConstMetric(m.phaseSeconds, prometheus.CounterValue, v, phase)
	}
	for id, ss := range c.s.sessions {
		pid := strconv.Itoa(ss.hello.PID)
		for b, u := range ss.usage() {
			ch <- prometheus.MustNewConstMetric(m.clientTensors, prometheus.GaugeValue, float64(u.tensors), id, pid, b)
			ch <- prometheus.MustNewConstMetric(m.clientState, prometheus.GaugeValue, float64(u.stateBytes), id, pid, b)
		}
	}
}

// MetricsHandler serves the server's metrics in Prometheus text format,
// with the Go runtime's (go_*: heap in use, goroutines, and
// go_gc_heap_live_bytes, the heap the last collection found live) and the
// process's (process_*: resident memory, open file descriptors) beside them.
func (s *Server) MetricsHandler() http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(s.m.requests, s.m.errors, s.m.bytes, s.m.latency, s.m.perReq, collector{s},
		collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(
			collectors.GoRuntimeMetricsRule{Matcher: regexp.MustCompile(`^/gc/heap/live:bytes$`)})),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

// forgetMetrics deletes a released client's series: nothing of a client
// outlives its session.
func (s *Server) forgetMetrics(client string) {
	s.m.perReq.DeletePartialMatch(prometheus.Labels{"client": client})
}
