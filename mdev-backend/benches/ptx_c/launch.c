/* The launch of launch.h: host threads share a counter of the next block. */
#include "launch.h"
#include <pthread.h>

/* Most host threads one launch runs on (the benchmark asks for 1 and 2). */
#define MAX_THREADS 16

typedef struct {
    BlockFn f;
    const Launch* l;
    unsigned next;
    unsigned blocks;
} Grid;

static void* worker(void* p) {
    Grid* g = p;
    for (;;) {
        unsigned b = __atomic_fetch_add(&g->next, 1, __ATOMIC_RELAXED);
        if (b >= g->blocks) return 0;
        g->f(g->l, b % g->l->grid[0], b / g->l->grid[0]);
    }
}

int run_blocks(BlockFn f, const Launch* l, unsigned threads) {
    Grid g = {f, l, 0, l->grid[0] * l->grid[1]};
    pthread_t t[MAX_THREADS];
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > g.blocks) threads = g.blocks; /* as the executor: no thread without a block */
    unsigned started = 0;
    for (; started + 1 < threads; started++)
        if (pthread_create(&t[started], 0, worker, &g)) break;
    worker(&g);
    for (unsigned k = 0; k < started; k++) pthread_join(t[k], 0);
    return (int)started + 1;
}
