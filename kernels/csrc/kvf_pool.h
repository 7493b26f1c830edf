// The worker's one CPU thread pool (csrc/thread_pool.c), shared by every native kernel.
//
// kvf_parallel(n, threads, body, ctx) runs tasks 0..n-1. The calling thread and up to
// threads - 1 pool threads each claim tasks from one counter; a thread that claimed one calls
// body(ctx, task, first, worker) once and takes more with kvf_next(task) until it returns -1.
// The call returns when every task is done: it never waits for a pool thread that has not
// claimed one (a thread the OS has descheduled, or one still waking), so with other processes
// on the cores a call runs at least as fast as the same call on one thread.
//
// Rules for body: read ctx only while holding a task (before kvf_next returns -1: after that
// the call may have returned and ctx be gone); write results before kvf_next. A task's result
// must not depend on which thread ran it (none of kvflow's kernels does: each output is
// computed by the same instructions wherever it runs).
#ifndef KVF_POOL_H
#define KVF_POOL_H

typedef struct kvf_task kvf_task;
typedef void (*kvf_body)(void *ctx, kvf_task *task, long first, int worker);

// 0, or -1 on bad arguments. A call made while another is running (another thread, or from
// inside a body) runs on its caller alone.
int kvf_parallel(long n, int threads, kvf_body body, void *ctx);

// Marks the task last claimed done and claims another: its index, or -1 when none is left.
long kvf_next(kvf_task *task);

// The common case: fn(ctx, i) for each i in 0..n-1, spread over the threads as above.
typedef void (*kvf_index_fn)(void *ctx, long i);
typedef struct {
    kvf_index_fn fn;
    void *ctx;
} kvf_for_ctx;

static void kvf_for_body(void *vctx, kvf_task *task, long i, int worker) {
    (void)worker;
    const kvf_for_ctx c = *(const kvf_for_ctx *)vctx;  // read while holding task i
    for (; i >= 0; i = kvf_next(task)) c.fn(c.ctx, i);
}

static inline int kvf_parallel_for(long n, int threads, kvf_index_fn fn, void *ctx) {
    kvf_for_ctx c = {fn, ctx};
    return kvf_parallel(n, threads, kvf_for_body, &c);
}

#endif
