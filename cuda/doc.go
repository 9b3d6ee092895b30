// Package cuda is Sonar-MoE's binding to the NVIDIA GPU: the CUDA driver API
// and NVRTC, both loaded at run time (libcuda.so.1 and libnvrtc.so.* through
// github.com/ebitengine/purego), so that every binary builds and its tests
// run on machines without CUDA; the GPU path turns on where a driver exists.
//
// It provides what the server needs and nothing more: a device's primary
// context, device memory, streams, events (including inter-process events),
// CUDA IPC memory handles opened once per base allocation (IPCCache), modules
// loaded from PTX, kernel launches, and the AdamW kernels of
// kernels/adamw.cu, compiled by NVRTC for the device at start-up.
//
// The kernels follow torch.optim.AdamW's default CUDA path (the foreach
// implementation, _multi_tensor_adam): every foreach op computes in float32
// and rounds to the parameter's dtype, exactly as docs/gpu.md lists. RefStep
// is the same arithmetic in Go, the reference the GPU check compares the
// kernel with.
//
// Threading: a CUDA context is current per OS thread, so every call that needs
// the context runs on a locked OS thread with the device's primary context
// made current (Device.Do); callers never handle contexts.
package cuda
