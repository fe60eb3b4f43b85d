// matmul(const float* A, const float* B, float* C, int n): C = A·B for n×n matrices, n a
// multiple of TILE, 16×16 tiles through shared memory; launch grid (n/16, n/16), block (16, 16).
// Each product is accumulated with fmaf in tile order, so a host loop in the same order is
// bit-exact.
#include "common.h"
#define TILE 16
__global__ void matmul(const float* A, const float* B, float* C, int n) {
    __shared__ float As[TILE][TILE], Bs[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y, col = blockIdx.x * TILE + threadIdx.x;
    float sum = 0.0f;
    for (int t = 0; t < n; t += TILE) {
        As[threadIdx.y][threadIdx.x] = A[row * n + t + threadIdx.x];
        Bs[threadIdx.y][threadIdx.x] = B[(t + threadIdx.y) * n + col];
        __syncthreads();
        for (int k = 0; k < TILE; k++) sum = fmaf(As[threadIdx.y][k], Bs[k][threadIdx.x], sum);
        __syncthreads();
    }
    C[row * n + col] = sum;
}
int main() {
    const int n = 128;
    float *hA = new float[n * n], *hB = new float[n * n], *hC = new float[n * n];
    for (int i = 0; i < n * n; i++) { hA[i] = (i * 7 % 13) - 6.0f; hB[i] = (i * 5 % 11) * 0.25f; }
    float *A, *B, *C;
    CHECK(cudaMalloc(&A, n * n * 4)); CHECK(cudaMalloc(&B, n * n * 4)); CHECK(cudaMalloc(&C, n * n * 4));
    CHECK(cudaMemcpy(A, hA, n * n * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(B, hB, n * n * 4, cudaMemcpyHostToDevice));
    matmul<<<dim3(n / TILE, n / TILE), dim3(TILE, TILE)>>>(A, B, C, n);
    CHECK(cudaMemcpy(hC, C, n * n * 4, cudaMemcpyDeviceToHost));
    for (int r = 0; r < n; r++)
        for (int c = 0; c < n; c++) {
            float s = 0.0f;
            for (int k = 0; k < n; k++) s = fmaf(hA[r * n + k], hB[k * n + c], s);
            if (s != hC[r * n + c]) { std::printf("FAIL at %d,%d\n", r, c); return 1; }
        }
    std::printf("PASS\n");
}
