// Package cuda is a binding of the NVIDIA CUDA driver API and NVRTC, both
// loaded at run time (libcuda.so.1 and libnvrtc.so.* through
// github.com/ebitengine/purego), so that every binary builds and its tests
// run on machines without CUDA; the GPU path turns on where a driver exists.
// It imports nothing of the project: what runs on the device (the AdamW
// kernels, their batches, the optimizer state) is the engine's, in package
// optimizer/device.
//
// It provides a device's primary context, device memory, streams, events
// (including inter-process events), CUDA IPC memory handles opened once per
// base allocation (IPCCache), modules loaded from PTX, kernel launches with
// by-value parameters (Args), and NVRTC compilation. Package cuda/cudatest is
// a stand-in libcuda.so.1 for tests.
//
// Threading: a CUDA context is current per OS thread, so every call that needs
// the context runs on a locked OS thread with the device's primary context
// made current (Device.Do); callers never handle contexts.
package cuda
