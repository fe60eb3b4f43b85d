// Shared by the corpus programs: a checked CUDA call and the PASS/FAIL line.
#pragma once
#include <cstdio>
#include <cstdlib>
#define CHECK(call)                                                                        \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            std::printf("FAIL %s: %s\n", #call, cudaGetErrorString(e_));                  \
            std::exit(1);                                                                  \
        }                                                                                  \
    } while (0)
