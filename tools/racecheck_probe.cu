// Two synchronisation patterns of the warp-specialized backward, alone, to ask
// compute-sanitizer's racecheck whether it models them (design notes, "Sanitizers"):
//
//   named   384 threads; warpgroup 0 (the producer) leaves, the other 256 stage values in
//           shared memory, meet at named barrier 11 (bar.sync 11, 256), read each other's
//           values, meet again (the dK/dV epilogue of bwd_warp_specialized.cuh).
//   bulk    one producer thread fills a two-stage ring with cp.async.bulk (complete_tx on a
//           "full" mbarrier) after each stage's "empty" mbarrier says the four consumer warps
//           are done with it; the consumers read the stage, __syncwarp, and lane 0 arrives
//           (the LSE/delta rows of the same kernel).
//
// Both are race-free by construction; each checks its result and prints it.
//
//   nvcc -arch=sm_90a -std=c++17 -I cuda_src -o racecheck_probe tools/racecheck_probe.cu
//   compute-sanitizer --tool racecheck ./racecheck_probe
#include <cstdio>
#include <cuda_runtime.h>

#include "ptx.cuh"

using namespace cudaflash;

constexpr int kConsumers = 256;

__global__ void __launch_bounds__(384) named(float* out) {
    __shared__ float tile[kConsumers];
    if (threadIdx.x < 128) return;  // the producer warpgroup
    const int c = threadIdx.x - 128;
    named_barrier_sync(11, kConsumers);  // (the kernel's first epilogue barrier)
    tile[c] = float(c);
    named_barrier_sync(11, kConsumers);
    out[c] = tile[(c + 37) % kConsumers];
}

constexpr int kStageFloats = 64, kSteps = 16;

__global__ void __launch_bounds__(160) bulk(const float* rows, float* out) {
    __shared__ alignas(128) float stage_rows[2][kStageFloats];
    __shared__ alignas(8) uint64_t full[2], empty[2];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int s = 0; s < 2; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], 4);
        }
        fence_proxy_async_shared();
    }
    __syncthreads();
    if (warp == 0) {
        if (lane != 0) return;
        for (int step = 0; step < kSteps; ++step) {
            const int s = step % 2;
            mbarrier_wait(&empty[s], ((step / 2) & 1) ^ 1);
            mbarrier_arrive_expect_tx(&full[s], kStageFloats * sizeof(float));
            bulk_load(smem_addr(stage_rows[s]), rows + step * kStageFloats,
                      kStageFloats * sizeof(float), &full[s]);
        }
        return;
    }
    float sum = 0.f;
    for (int step = 0; step < kSteps; ++step) {
        const int s = step % 2;
        mbarrier_wait(&full[s], (step / 2) & 1);
        sum += stage_rows[s][lane] + stage_rows[s][lane + 32];
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty[s]);
    }
    out[threadIdx.x - 32] = sum;
}

int main() {
    float *rows, *out;
    cudaMalloc(&rows, kSteps * kStageFloats * sizeof(float));
    cudaMalloc(&out, kConsumers * sizeof(float));
    float host[kSteps * kStageFloats];
    for (int i = 0; i < kSteps * kStageFloats; ++i) host[i] = float(i % kStageFloats);
    cudaMemcpy(rows, host, sizeof(host), cudaMemcpyHostToDevice);

    named<<<4, 384>>>(out);
    float named_out[kConsumers];
    cudaMemcpy(named_out, out, sizeof(named_out), cudaMemcpyDeviceToHost);
    int wrong = 0;
    for (int c = 0; c < kConsumers; ++c) wrong += named_out[c] != float((c + 37) % kConsumers);
    printf("named: %s\n", wrong ? "WRONG" : "ok");

    bulk<<<4, 160>>>(rows, out);
    float bulk_out[128];
    cudaMemcpy(bulk_out, out, sizeof(bulk_out), cudaMemcpyDeviceToHost);
    wrong = 0;
    for (int t = 0; t < 128; ++t)
        wrong += bulk_out[t] != float(kSteps * ((t % 32) + (t % 32) + 32));
    printf("bulk: %s\n", wrong ? "WRONG" : "ok");
    const cudaError_t e = cudaDeviceSynchronize();
    printf("%s\n", cudaGetErrorString(e));
    return wrong || e != cudaSuccess;
}
