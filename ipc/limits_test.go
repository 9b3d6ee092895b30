package ipc

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"go.uber.org/zap"
)

// TestReadFrameAllocatesAsBytesArrive announces frames and sends only part
// of them: readFrame takes memory for what arrived (plus at most a chunk),
// not for what the header announced.
func TestReadFrameAllocatesAsBytesArrive(t *testing.T) {
	for _, tc := range []struct {
		name           string
		announced      int
		sent           int // payload bytes that arrive before the stream ends
		wantErr        bool
		maxAllocBeyond int // bytes allocated beyond those sent, at most
	}{
		{name: "header only, 4 MiB announced", announced: 4 << 20, sent: 0, wantErr: true, maxAllocBeyond: 2 * frameChunk},
		{name: "1 MiB of 4 MiB", announced: 4 << 20, sent: 1 << 20, wantErr: true, maxAllocBeyond: 2 * frameChunk},
		{name: "small complete", announced: 100, sent: 100, maxAllocBeyond: 64 << 10},
		{name: "4 MiB complete", announced: 4 << 20, sent: 4 << 20, maxAllocBeyond: (4 << 20) + 2*frameChunk},
	} {
		t.Run(tc.name, func(t *testing.T) {
			data := make([]byte, frameHeader+tc.sent)
			binary.LittleEndian.PutUint32(data, uint32(tc.announced))
			for i := frameHeader; i < len(data); i++ {
				data[i] = byte(i)
			}
			r := bufio.NewReaderSize(bytes.NewReader(data), 64<<10)
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			b, err := readFrame(r, MaxMessageBytes, nil)
			runtime.ReadMemStats(&after)
			if (err != nil) != tc.wantErr {
				t.Fatalf("readFrame: %v (want error: %v)", err, tc.wantErr)
			}
			if err == nil && (len(b) != tc.announced || !bytes.Equal(b, data[frameHeader:])) {
				t.Fatalf("frame of %d bytes, want %d as sent", len(b), tc.announced)
			}
			if got := int(after.TotalAlloc - before.TotalAlloc); got > tc.sent+tc.maxAllocBeyond {
				t.Fatalf("allocated %d bytes for %d received (announced %d)", got, tc.sent, tc.announced)
			}
		})
	}
}

// serveUnixWith is serveUnix with the transport's deadlines and connection
// bound set.
func serveUnixWith(t *testing.T, h Handler, hello, frame time.Duration, maxConns int) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "run", "s.sock")
	tr, err := ListenUnix("unix://"+path, zap.NewNop(), Options{MaxConns: maxConns})
	if err != nil {
		t.Fatal(err)
	}
	tr.HelloTimeout, tr.FrameTimeout = hello, frame
	t.Cleanup(startServing(t, tr, h, path))
	return path
}

// closedWithin says whether the server closes c within d (a read ends with
// EOF or a reset, not with c's own deadline).
func closedWithin(c net.Conn, d time.Duration) bool {
	_ = c.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

// TestUnixDeadlines: a connection that sends no id, or stalls inside a
// frame, is closed after its deadline; an identified connection idle between
// requests is not.
func TestUnixDeadlines(t *testing.T) {
	const timeout = 300 * time.Millisecond
	path := serveUnixWith(t, &stubHandler{}, timeout, timeout, 0)
	header := func(n int) []byte { return binary.LittleEndian.AppendUint32(nil, uint32(n)) }
	id := append(header(3), "abc"...)
	for _, tc := range []struct {
		name       string
		send       []byte
		wantClosed bool
	}{
		{name: "nothing sent", wantClosed: true},
		{name: "half an id header", send: []byte{3, 0}, wantClosed: true},
		{name: "id then a header only", send: append(append([]byte{}, id...), header(4<<20)...), wantClosed: true},
		{name: "id then part of a frame", send: append(append(append([]byte{}, id...), header(1000)...), make([]byte, 999)...), wantClosed: true},
		{name: "id then idle", send: id, wantClosed: false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := net.Dial("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if len(tc.send) > 0 {
				if _, err := c.Write(tc.send); err != nil {
					t.Fatal(err)
				}
			}
			if got := closedWithin(c, 4*timeout); got != tc.wantClosed {
				t.Fatalf("closed by the server: %v, want %v", got, tc.wantClosed)
			}
			if !tc.wantClosed { // still served after being idle past both deadlines
				u := &unixClient{t: t, c: c, r: bufio.NewReader(c)}
				_ = c.SetDeadline(time.Now().Add(5 * time.Second))
				u.frame(envelope(t, Version, "ping", 9, nil))
				if r := u.mustReply(); !r.OK || r.ID != 9 {
					t.Fatalf("reply after idling: %+v", r)
				}
			}
		})
	}
}

// TestUnixMaxConns: past MaxConns a connection is refused with an error and
// closed; once one closes, a new one is served.
func TestUnixMaxConns(t *testing.T) {
	path := serveUnixWith(t, &stubHandler{}, time.Minute, time.Minute, 2)
	a := dialUnix(t, path, []byte("a"))
	dialUnix(t, path, nil) // not identified: counts too
	// ping dials a connection and sends a ping. The server refuses at accept
	// and closes at once, so the client's writes may find the connection
	// closed (EPIPE): only the reply, a refusal already sent, must be read.
	ping := func(name string) (stubReply, error) {
		c := dialUnix(t, path, nil)
		_ = writeFrame(c.c, []byte(name))
		_ = writeFrame(c.c, envelope(t, Version, "ping", 1, nil))
		return c.reply()
	}
	refused := func(r stubReply, err error) bool {
		return err == nil && strings.Contains(r.Error, "too many connections")
	}
	t.Run("third refused", func(t *testing.T) {
		// Connections are accepted in order, so the third is refused
		// however long the server took to accept the first two.
		if r, err := ping("c-third"); !refused(r, err) {
			t.Fatalf("reply %+v, %v: want a refusal", r, err)
		}
	})
	t.Run("after one closed", func(t *testing.T) {
		a.c.Close()
		// The server notices the close when its read returns: poll, so that
		// a loaded machine is not a failure, but not forever.
		deadline := time.Now().Add(10 * time.Second)
		for {
			r, err := ping("c-after")
			if err == nil && r.OK {
				return
			}
			if !refused(r, err) || time.Now().After(deadline) {
				t.Fatalf("reply %+v, %v: want it served", r, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

// TestZMQTooManyFrames sends messages of several shapes: a request of more
// frames than a request can have is refused, unexecuted, with an error
// saying how many frames came; the client is served afterwards.
func TestZMQTooManyFrames(t *testing.T) {
	h := &stubHandler{}
	addr, _ := serve(t, h)
	d := dealer(t, addr)
	big := make([]byte, 1<<20)
	for _, tc := range []struct {
		name   string
		frames [][]byte
		want   string // "" when served
	}{
		{name: "one payload", frames: [][]byte{envelope(t, Version, "ping", 1, nil)}},
		{name: "two payloads", frames: [][]byte{big, envelope(t, Version, "ping", 2, nil)}, want: "expected 1 payload frame, got 2"},
		{name: "three payloads", frames: [][]byte{big, big, envelope(t, Version, "ping", 3, nil)}, want: "expected 1 payload frame, got 3"},
		{name: "four payloads", frames: [][]byte{big, big, big, envelope(t, Version, "ping", 3, nil)}, want: "message of 5 frames"},
		{name: "forty payloads", frames: append(bytes.SplitAfterN(make([]byte, 39), []byte{}, 39), envelope(t, Version, "ping", 4, nil)), want: "message of 41 frames"},
		{name: "served after", frames: [][]byte{envelope(t, Version, "ping", 5, nil)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			calls, _ := h.count()
			parts := make([]any, len(tc.frames))
			for i, f := range tc.frames {
				parts[i] = f
			}
			if _, err := d.SendMessage(parts...); err != nil {
				t.Fatal(err)
			}
			_, r := recvReply(t, d)
			after, _ := h.count()
			switch {
			case tc.want == "" && (!r.OK || after != calls+1):
				t.Fatalf("reply %+v (%d calls): want served", r, after-calls)
			case tc.want != "" && (r.OK || !strings.Contains(r.Error, tc.want) || after != calls):
				t.Fatalf("reply %+v (%d calls): want an error with %q, unexecuted", r, after-calls, tc.want)
			}
		})
	}
}

// TestZMQMaxConns: connections past MaxConns are closed as soon as they are
// accepted; the first ones are served throughout.
func TestZMQMaxConns(t *testing.T) {
	path := filepath.Join(t.TempDir(), "run", "s.sock")
	addr := "ipc://" + path
	tr, err := Listen(addr, zap.NewNop(), nil, Options{MaxConns: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(startServing(t, tr, &stubHandler{}, path))
	ping := func(d *zmq.Socket, id uint64) (stubReply, error) {
		if _, err := d.SendBytes(envelope(t, Version, "ping", id, nil), 0); err != nil {
			return stubReply{}, err
		}
		_ = d.SetRcvtimeo(time.Second)
		_, err := d.RecvMessageBytes(0)
		return stubReply{ID: id, OK: err == nil}, err
	}
	first := []*zmq.Socket{dealer(t, addr), dealer(t, addr)}
	for i, d := range first {
		if _, err := ping(d, uint64(i+1)); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
	}
	for _, tc := range []struct {
		name   string
		served bool
	}{
		{"third", false},
		{"fourth", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ping(dealer(t, addr), 10)
			if (err == nil) != tc.served {
				t.Fatalf("ping: %v, want served %v", err, tc.served)
			}
		})
	}
	for i, d := range first {
		if _, err := ping(d, uint64(20+i)); err != nil {
			t.Fatalf("connection %d after the refusals: %v", i, err)
		}
	}
}

// TestErrorReplyBounded: an error whose text is huge (a handler that quotes
// a request in full) is cut to MaxErrorBytes in the reply.
func TestErrorReplyBounded(t *testing.T) {
	for _, n := range []int{10, MaxErrorBytes, 4 << 20} {
		rep := execute(errHandler(strings.Repeat("E", n)), zap.NewNop(), "c", envelope(t, Version, "x", 1, nil), 0)
		if len(rep.Error) > MaxErrorBytes+64 || (n <= MaxErrorBytes && len(rep.Error) != n) {
			t.Errorf("error of %d bytes: reply carries %d", n, len(rep.Error))
		}
	}
}

type errHandler string

func (e errHandler) Handle(string, Request) (any, error) { return nil, errors.New(string(e)) }
