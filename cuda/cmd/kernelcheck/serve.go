package main

import (
	"bufio"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"sync"
	"time"

	"github.com/sonar-moe/sonar/cuda"
	"github.com/sonar-moe/sonar/ipcbridge"
	"github.com/sonar-moe/sonar/optimizer"
)

// serve is a stand-in for sonard's CUDA path until the server is integrated:
// the same steps (map client memory by IPC handle through the cache, order
// the kernels after the client's stream with its interprocess event, one
// multi-tensor launch per request, reply once the kernels finished, never a
// device-wide synchronize) behind a line protocol a Python script can drive:
//
//	{"op":"event","handle":HEX}                      the client's interprocess event (torch.cuda.Event(interprocess=True).ipc_handle())
//	{"op":"register","name":S,"dtype":D,"numel":N,"amsgrad":B,"param":REF}  -> {"tensor":ID}
//	{"op":"step","wait_event":B,"items":[{"tensor":ID,"grad":REF,"apply":B,"scalars":{...}}]}
//	{"op":"export","tensor":ID,"exp_avg":REF,"exp_avg_sq":REF}  copy the state into client memory
//	{"op":"stats"}  {"op":"time_open","handle":HEX,"repeat":N}  {"op":"quit"}
//
// REF is {"handle":HEX,"offset":BYTES}: HEX is the handle torch's
// UntypedStorage._share_cuda_() returns (hex-encoded), BYTES the tensor's
// offset in that allocation. Every request carries an "id" echoed in its
// reply; replies come in request order, each {"id":..,"ok":true,...} or
// {"id":..,"ok":false,"error":..}.
type request struct {
	Op        string      `json:"op"`
	ID        uint64      `json:"id"`
	Handle    string      `json:"handle"`
	Repeat    int         `json:"repeat"`
	Name      string      `json:"name"`
	DType     string      `json:"dtype"`
	Numel     int64       `json:"numel"`
	Amsgrad   bool        `json:"amsgrad"`
	Param     *memRef     `json:"param"`
	WaitEvent bool        `json:"wait_event"`
	Items     []stepItem  `json:"items"`
	Tensor    uint32      `json:"tensor"`
	ExpAvg    *memRef     `json:"exp_avg"`
	ExpAvgSq  *memRef     `json:"exp_avg_sq"`
	Scalars   ScalarsJSON `json:"scalars"`
}

type memRef struct {
	Handle string `json:"handle"`
	Offset int64  `json:"offset"`
}

type stepItem struct {
	Tensor  uint32      `json:"tensor"`
	Grad    *memRef     `json:"grad"`
	Apply   bool        `json:"apply"`
	Scalars ScalarsJSON `json:"scalars"`
}

type saTensor struct {
	name       string
	dt         optimizer.DType
	numel, nb  int64
	param      ipcbridge.DeviceMapping
	paramPtr   cuda.DevicePtr
	m, v, vmax cuda.DevicePtr
	accum      cuda.DevicePtr
	accumN     int
	amsgrad    bool
}

// reply is queued in request order; done (if set) is waited for before the
// reply is written and the mappings are released.
type reply struct {
	body    map[string]any
	done    *cuda.Event
	release []ipcbridge.DeviceMapping
}

type standIn struct {
	g          *gpu
	s          *cuda.Stream
	cache      *cuda.IPCCache
	mapper     *ipcbridge.CUDAMapper
	clientEv   *cuda.Event
	tensors    map[uint32]*saTensor
	next       uint32
	stateBytes int64
	queue      chan reply
	wg         sync.WaitGroup
	out        *json.Encoder
}

func serve(in io.Reader, out io.Writer) error {
	g, err := openGPU()
	if err != nil {
		return err
	}
	defer g.close()
	s, err := g.dev.NewStream()
	if err != nil {
		return err
	}
	cache := cuda.NewIPCCache(g.dev, 64)
	sa := &standIn{g: g, s: s, cache: cache, mapper: ipcbridge.NewCUDAMapperWith(cache), tensors: map[uint32]*saTensor{},
		queue: make(chan reply, 1024), out: json.NewEncoder(out)}
	sa.wg.Add(1)
	go sa.replies()
	err = sa.loop(in)
	close(sa.queue)
	sa.wg.Wait()
	sa.shutdown()
	return err
}

// replies writes the replies in order, each once its kernels finished.
func (sa *standIn) replies() {
	defer sa.wg.Done()
	for r := range sa.queue {
		if r.done != nil {
			if err := r.done.Sync(); err != nil {
				r.body = map[string]any{"id": r.body["id"], "ok": false, "error": err.Error()}
			}
			_ = r.done.Destroy()
		}
		for _, m := range r.release {
			_ = m.Close()
		}
		_ = sa.out.Encode(r.body)
	}
}

func (sa *standIn) loop(in io.Reader) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	for sc.Scan() {
		var req request
		if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
			sa.queue <- reply{body: map[string]any{"id": 0, "ok": false, "error": "bad request: " + err.Error()}}
			continue
		}
		r, err := sa.handle(req)
		if err != nil {
			for _, m := range r.release {
				_ = m.Close()
			}
			r = reply{body: map[string]any{"ok": false, "error": fmt.Sprintf("%s (request %d): %v", req.Op, req.ID, err)}}
		}
		if r.body == nil {
			r.body = map[string]any{}
		}
		r.body["id"] = req.ID
		if _, ok := r.body["ok"]; !ok {
			r.body["ok"] = true
		}
		sa.queue <- r
		if req.Op == "quit" && err == nil {
			return nil
		}
	}
	return sc.Err()
}

func decodeHandle(s string) ([]byte, error) {
	b, err := hex.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("handle is not hex: %w", err)
	}
	return b, nil
}

// mapRef maps n bytes at ref (aligned to align); the caller closes the mapping.
func (sa *standIn) mapRef(ref *memRef, n, align int64) (ipcbridge.DeviceMapping, cuda.DevicePtr, error) {
	if ref == nil {
		return nil, 0, errors.New("missing memory reference")
	}
	h, err := decodeHandle(ref.Handle)
	if err != nil {
		return nil, 0, err
	}
	m, err := sa.mapper.MapDevice(h, 0)
	if err != nil {
		return nil, 0, err
	}
	p, err := m.Ptr(ref.Offset, n, align)
	if err != nil {
		_ = m.Close()
		return nil, 0, err
	}
	return m, p, nil
}

// done records an event after everything queued so far.
func (sa *standIn) done() (*cuda.Event, error) {
	ev, err := sa.g.dev.NewEvent(cuda.EventSync)
	if err != nil {
		return nil, err
	}
	if err := ev.Record(sa.s); err != nil {
		_ = ev.Destroy()
		return nil, err
	}
	return ev, nil
}

func (sa *standIn) handle(req request) (reply, error) {
	switch req.Op {
	case "event":
		h, err := decodeHandle(req.Handle)
		if err != nil {
			return reply{}, err
		}
		var eh cuda.IPCEventHandle
		if len(h) != len(eh.Reserved) {
			return reply{}, fmt.Errorf("event handle is %d bytes, want %d", len(h), len(eh.Reserved))
		}
		copy(eh.Reserved[:], h)
		ev, err := sa.g.dev.OpenIPCEvent(eh)
		if err != nil {
			return reply{}, err
		}
		if sa.clientEv != nil {
			_ = sa.clientEv.Destroy()
		}
		sa.clientEv = ev
		return reply{}, nil
	case "register":
		return sa.register(req)
	case "step":
		return sa.step(req)
	case "export":
		return sa.export(req)
	case "stats":
		free, total, err := sa.g.dev.MemInfo()
		if err != nil {
			return reply{}, err
		}
		st := sa.cache.Stats()
		return reply{body: map[string]any{"state_bytes": sa.stateBytes, "tensors": len(sa.tensors),
			"ipc_open": st.Open, "ipc_idle": st.Idle, "ipc_bytes": st.Bytes, "ipc_opens": st.Opens,
			"device_used": total - free}}, nil
	case "time_open":
		return sa.timeOpen(req)
	case "quit":
		return reply{}, nil
	}
	return reply{}, fmt.Errorf("unknown op %q", req.Op)
}

func (sa *standIn) register(req request) (reply, error) {
	dt, err := optimizer.ParseDType(req.DType)
	if err != nil {
		return reply{}, err
	}
	if req.Numel <= 0 {
		return reply{}, fmt.Errorf("numel %d", req.Numel)
	}
	t := &saTensor{name: req.Name, dt: dt, numel: req.Numel, nb: req.Numel * int64(dt.Size()), amsgrad: req.Amsgrad}
	t.param, t.paramPtr, err = sa.mapRef(req.Param, t.nb, int64(dt.Size()))
	if err != nil {
		return reply{}, fmt.Errorf("tensor %q param: %w", req.Name, err)
	}
	bufs := []*cuda.DevicePtr{&t.m, &t.v}
	if t.amsgrad {
		bufs = append(bufs, &t.vmax)
	}
	for _, b := range bufs {
		if *b, err = sa.g.dev.Alloc(t.nb); err != nil {
			sa.free(t)
			return reply{}, err
		}
		sa.stateBytes += t.nb
		if err := sa.s.Zero(*b, t.nb); err != nil {
			sa.free(t)
			return reply{}, err
		}
	}
	sa.next++
	sa.tensors[sa.next] = t
	return reply{body: map[string]any{"tensor": sa.next}}, nil
}

func (sa *standIn) free(t *saTensor) {
	for _, p := range []cuda.DevicePtr{t.m, t.v, t.vmax, t.accum} {
		if p != 0 {
			_ = sa.g.dev.Free(p)
			sa.stateBytes -= t.nb
		}
	}
	if t.param != nil {
		_ = t.param.Close()
	}
}

func (sa *standIn) step(req request) (reply, error) {
	var r reply
	type work struct {
		t    *saTensor
		grad cuda.DevicePtr
		it   stepItem
	}
	var ws []work
	seen := map[uint32]bool{}
	for i, it := range req.Items { // validate and map everything first
		t := sa.tensors[it.Tensor]
		if t == nil {
			return r, fmt.Errorf("item %d: unknown tensor %d", i, it.Tensor)
		}
		if seen[it.Tensor] {
			return r, fmt.Errorf("item %d: tensor %d twice", i, it.Tensor)
		}
		seen[it.Tensor] = true
		var gp cuda.DevicePtr
		if it.Grad != nil {
			m, p, err := sa.mapRef(it.Grad, t.nb, int64(t.dt.Size()))
			if err != nil {
				return r, fmt.Errorf("item %d (%s) grad: %w", i, t.name, err)
			}
			r.release = append(r.release, m)
			if p < t.paramPtr+cuda.DevicePtr(t.nb) && t.paramPtr < p+cuda.DevicePtr(t.nb) {
				return r, fmt.Errorf("item %d (%s): gradient overlaps the parameter", i, t.name)
			}
			gp = p
		} else if !it.Apply || t.accumN == 0 {
			return r, fmt.Errorf("item %d (%s): no gradient", i, t.name)
		}
		if it.Apply && it.Scalars.Amsgrad != t.amsgrad {
			return r, fmt.Errorf("item %d (%s): amsgrad differs from registration", i, t.name)
		}
		ws = append(ws, work{t, gp, it})
	}
	if req.WaitEvent {
		if sa.clientEv == nil {
			return r, errors.New("wait_event without an event (op event first)")
		}
		if err := sa.s.WaitEvent(sa.clientEv); err != nil {
			return r, err
		}
	}
	start := time.Now()
	batches := map[optimizer.DType][]cuda.Tensor{}
	for _, w := range ws {
		t, grad := w.t, w.grad
		if !w.it.Apply || t.accumN > 0 {
			if err := sa.accumulate(t, grad); err != nil {
				return r, err
			}
			if !w.it.Apply {
				continue
			}
			grad = t.accum
			t.accumN = 0
		}
		batches[t.dt] = append(batches[t.dt], cuda.Tensor{Param: t.paramPtr, Grad: grad, ExpAvg: t.m, ExpAvgSq: t.v,
			MaxExpAvgSq: t.vmax, Numel: t.numel, Scalars: w.it.Scalars.scalars()})
	}
	for dt, items := range batches {
		if err := sa.g.k.AdamW(sa.s, dt, items); err != nil {
			return r, err
		}
	}
	ev, err := sa.done()
	if err != nil {
		return r, err
	}
	r.done = ev
	r.body = map[string]any{"items": len(ws), "queue_us": time.Since(start).Microseconds()}
	return r, nil
}

// accumulate adds grad into t's accumulation buffer (the first one is copied).
func (sa *standIn) accumulate(t *saTensor, grad cuda.DevicePtr) error {
	if grad == 0 {
		return nil
	}
	if t.accum == 0 {
		p, err := sa.g.dev.Alloc(t.nb)
		if err != nil {
			return err
		}
		t.accum = p
		sa.stateBytes += t.nb
	}
	if t.accumN == 0 {
		if err := sa.s.CopyDtoD(t.accum, grad, t.nb); err != nil {
			return err
		}
	} else if err := sa.g.k.Accumulate(sa.s, t.dt, []cuda.AddItem{{Dst: t.accum, Src: grad, Numel: t.numel}}); err != nil {
		return err
	}
	t.accumN++
	return nil
}

func (sa *standIn) export(req request) (reply, error) {
	var r reply
	t := sa.tensors[req.Tensor]
	if t == nil {
		return r, fmt.Errorf("unknown tensor %d", req.Tensor)
	}
	for _, x := range []struct {
		ref *memRef
		src cuda.DevicePtr
	}{{req.ExpAvg, t.m}, {req.ExpAvgSq, t.v}} {
		m, p, err := sa.mapRef(x.ref, t.nb, int64(t.dt.Size()))
		if err != nil {
			return r, err
		}
		r.release = append(r.release, m)
		if err := sa.s.CopyDtoD(p, x.src, t.nb); err != nil {
			return r, err
		}
	}
	ev, err := sa.done()
	if err != nil {
		return r, err
	}
	r.done = ev
	return r, nil
}

// timeOpen measures cuIpcOpenMemHandle + cuIpcCloseMemHandle of an
// allocation the cache does not hold: what each cache miss costs.
func (sa *standIn) timeOpen(req request) (reply, error) {
	hb, err := decodeHandle(req.Handle)
	if err != nil {
		return reply{}, err
	}
	h, err := cuda.ParseTorchHandle(hb)
	if err != nil {
		return reply{}, err
	}
	n := max(req.Repeat, 1)
	var opens, closes []float64
	var size int64
	for i := 0; i < n; i++ {
		t0 := time.Now()
		p, sz, err := sa.g.dev.OpenIPCMem(h)
		if err != nil {
			return reply{}, err
		}
		t1 := time.Now()
		if err := sa.g.dev.CloseIPCMem(p); err != nil {
			return reply{}, err
		}
		opens = append(opens, float64(t1.Sub(t0).Microseconds()))
		closes = append(closes, float64(time.Since(t1).Microseconds()))
		size = sz
	}
	sort.Float64s(opens)
	sort.Float64s(closes)
	return reply{body: map[string]any{"bytes": size, "open_us_median": opens[n/2], "close_us_median": closes[n/2], "repeat": n}}, nil
}

func (sa *standIn) shutdown() {
	_ = sa.s.Sync()
	for _, t := range sa.tensors {
		sa.free(t)
	}
	if sa.clientEv != nil {
		_ = sa.clientEv.Destroy()
	}
	_ = sa.cache.Close()
	_ = sa.s.Destroy()
}
