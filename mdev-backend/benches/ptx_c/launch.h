/* The C versions of the corpus kernels that benches/ptx_engines.rs times against the PTX
 * engines: one function per kernel running one block (its threads in a loop, split into
 * phases at each barrier, warps' shuffles over arrays of lanes), and the launch that spreads
 * the grid's blocks over host threads taking the next block from a shared counter, as the
 * PTX executor does. */
#pragma once
#include <stdint.h>

/* One launch: its grid and block, its buffers (host copies) and its integer and float
 * arguments in the order the kernel takes them. */
typedef struct {
    unsigned grid[3], block[3];
    void* buf[6];
    long long i[4];
    float f[2];
} Launch;

typedef void (*BlockFn)(const Launch* l, unsigned bx, unsigned by);

/* Runs every block of `l` with `f` on `threads` host threads (1 runs them on the caller's),
 * no more than there are blocks; returns the threads it ran on. */
int run_blocks(BlockFn f, const Launch* l, unsigned threads);

/* An exported kernel `name`, launching `name##_block` over the grid. */
#define KERNEL(name)                                                     \
    static void name##_block(const Launch* l, unsigned bx, unsigned by); \
    int name(const Launch* l, unsigned threads) { return run_blocks(name##_block, l, threads); }
