// Package device is the engine's CUDA side, the peer of package optimizer's
// CPU engine: it owns the CUDA C source of the AdamW kernels (adamw.cu: the
// arithmetic of torch's foreach AdamW, which optimizer.ForeachStep spells in
// Go, and of its fused CUDA AdamW, optimizer.FusedCUDAStep; a step's
// Scalars.Fused picks one), compiles it with NVRTC through package cuda, packs batches of tensors
// into launch descriptors, and keeps every tensor's optimizer state
// (exp_avg, exp_avg_sq, max_exp_avg_sq, the accumulation buffer and the step
// count) in device memory. Parameters and gradients are device addresses the
// caller resolved (a client's memory opened by CUDA IPC, or the engine's own
// allocations in tests).
//
// Every Step queues its launches on the engine's stream and waits for them
// before returning, so a caller may reuse gradients and free state as soon
// as a call returns. The step counter of a tensor advances here, as it does
// in optimizer.Engine.Apply.
package device
