package server

import (
	"strings"
	"testing"

	"github.com/sonar-moe/sonar/ipc"
)

// On a server without a GPU (EnableCUDA never called) the CUDA requests are
// answered with a clear error and change nothing; CPU requests work as
// before.
func TestCUDARequestsWithoutGPU(t *testing.T) {
	w := newWorld(t)
	hello := w.must(w.client, ipc.OpHello, ipc.Hello{Client: "test"}).(ipc.HelloReply)
	if hello.CUDA != "" {
		t.Errorf("hello reports CUDA %q on a server without it", hello.CUDA)
	}
	torchHandle := append([]byte{1, 'c'}, make([]byte, 64)...)
	before := w.snapshot()
	errsBefore := w.s.Stats().Errors
	cases := []struct {
		op   string
		body any
		want string
	}{
		{ipc.OpAttachCUDA, ipc.AttachCUDA{Handle: torchHandle, Size: 1 << 20}, "no CUDA path"},
		{ipc.OpAttachCUDA, ipc.AttachCUDA{Handle: make([]byte, 64)}, "no CUDA path"},
		{ipc.OpCUDAEvent, ipc.CUDAEvent{Handle: make([]byte, 64)}, "no CUDA path"},
		{ipc.OpAttachCUDA, ipc.AttachCUDA{Handle: make([]byte, 10)}, "handle of 10 bytes"},
		{ipc.OpAttachCUDA, ipc.AttachCUDA{Handle: torchHandle, Size: -1}, "negative size"},
		{ipc.OpAttachCUDA, nil, "missing body"},
		{ipc.OpCUDAEvent, ipc.CUDAEvent{Handle: torchHandle}, "event handle of 66 bytes"},
		{ipc.OpStep, ipc.Step{Items: []ipc.StepItem{w.item(0, w.newGrad(0, 0), true)}, WaitEvent: true}, "wait_event is for CUDA tensors only"},
	}
	for _, tc := range cases {
		_, err := w.call(w.client, tc.op, tc.body)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %+v: error %v, want one containing %q", tc.op, tc.body, err, tc.want)
		}
	}
	// newGrad wrote into the grad segment: take the snapshot of segments
	// from now on, the server's state must be as before.
	after := w.snapshot()
	after.segs = before.segs
	if d := before.diff(after); d != "" {
		t.Errorf("refused CUDA requests changed %s", d)
	}
	st := w.s.Stats()
	if st.Errors != errsBefore+int64(len(cases)) {
		t.Errorf("errors %d, want %d", st.Errors, errsBefore+int64(len(cases)))
	}
	if st.ByOp[ipc.OpAttachCUDA] != 5 || st.ByOp[ipc.OpCUDAEvent] != 2 || st.ByOp["unknown"] != 0 {
		t.Errorf("by_op %v", st.ByOp)
	}
	if st.DeviceStateBytes != 0 || st.DeviceSegments != 0 || st.IPCOpen != 0 {
		t.Errorf("CUDA stats on a server without CUDA: %+v", st)
	}
	// The CPU path still works after the refusals.
	w.applyAll()
}
