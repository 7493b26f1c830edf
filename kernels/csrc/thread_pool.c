// The worker's one CPU thread pool (the contract is in kvf_pool.h).
//
// Why not OpenMP: a `#pragma omp parallel` region ends in a barrier that waits for every thread
// of its team. A decode step runs a few hundred regions, and on a serving machine the worker's
// threads share the cores with the gateway, scheduler, clients and other pods: whenever one of
// its threads is descheduled, every region waits a time slice for it (issue 38 measured 2-9x
// slower steps with one busy process beside the worker, slower than the same step on one
// thread). Here the caller and the pool's threads claim tasks from one counter, and the call
// waits only for tasks that were claimed: a thread that is not running claims nothing. Each
// thread counts the tasks it finished into the job once, when it runs out.
//
// One job at a time: `next` holds the job's generation (high 32 bits) and the next unclaimed
// task (low 32). A claim is a compare-and-swap on the whole word, so a thread that wakes late
// and still holds an old generation can never claim a task of a newer job, and a successful
// claim also proves the job's fields it read before were that job's (they are rewritten only
// after every task of the job is done). Pool threads spin a short while for the next job (steps
// call kernels back to back), then sleep on a condition variable.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "kvf_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define MAX_THREADS 256
// Spins before sleeping: a pool thread's for the next job, a caller's for tasks still running.
// Measured against 0/0, 20/5, 200/100, 200/400 and 2000/50 us: none stood out of the noise.
#define POOL_SPIN_NS 50000
#define CALLER_SPIN_NS 20000

typedef struct {
    // claims and completions on cache lines of their own (two threads hit them per task)
    _Alignas(64) _Atomic uint64_t next;  // generation << 32 | next unclaimed task
    _Alignas(64) _Atomic long done;      // tasks finished in this generation
    _Atomic int waiting;                 // the caller sleeps until done == n
    _Alignas(64) long n;
    kvf_body body;
    void *ctx;
    _Atomic int threads;  // pool threads 0 .. threads - 2 take part
} job_t;

struct kvf_task {  // one thread's part in one job
    job_t *job;
    uint32_t gen;
    int worker;
    long next, end;  // its claimed tasks not yet started
    long finished;   // tasks it has finished, counted into job->done when it runs out
};

static struct {
    pthread_mutex_t submit;  // held by the one running call
    pthread_mutex_t lock;    // guards the sleep below
    pthread_cond_t wake;
    pthread_cond_t finished;  // the caller's sleep (under lock) until its job is done
    _Atomic uint32_t published;  // the generation of the newest job
    _Atomic int sleepers;
    _Atomic int started;  // pool threads running
    _Atomic long stall_us;     // self-test only: pool threads pause this long before claiming
    _Atomic int stalling;      // self-test only: a pool thread is in that pause
    uint32_t gen;
    job_t job;
} pool = {
    .submit = PTHREAD_MUTEX_INITIALIZER,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .finished = PTHREAD_COND_INITIALIZER,
};

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

// Claims the next tasks of generation `gen`: the first one's index (and *end, one past the
// last), or -1. A claim takes 1/(4 x threads) of what is left (at least one task): few claims
// per job (two threads hitting one cache line per task cost ~2 ms per decode step), and what a
// descheduled thread can hold up stays small. With body/ctx given, also reads the job's function
// and context (valid only when a task was claimed).
static long claim(job_t *job, uint32_t gen, long *end, kvf_body *body, void **ctx) {
    uint64_t v = atomic_load_explicit(&job->next, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(v >> 32) != gen) return -1;
        const long i = (long)(uint32_t)v, n = job->n;
        if (i >= n) return -1;
        const int threads = atomic_load_explicit(&job->threads, memory_order_relaxed);
        long k = (n - i) / (4L * (threads > 1 ? threads : 1));
        k = k < 1 ? 1 : k;
        if (body) {
            *body = job->body;
            *ctx = job->ctx;
        }
        if (atomic_compare_exchange_weak_explicit(&job->next, &v, v + (uint64_t)k,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            *end = i + k;
            return i;
        }
    }
}

long kvf_next(kvf_task *task) {
    task->finished++;
    if (task->next < task->end) return task->next++;
    job_t *job = task->job;
    const long i = claim(job, task->gen, &task->end, NULL, NULL);
    if (i >= 0) {
        task->next = i + 1;
        return i;
    }
    // out of tasks: count this thread's as done, in one add (the caller waits for n)
    if (atomic_fetch_add(&job->done, task->finished) + task->finished == job->n &&
        atomic_load(&job->waiting)) {
        pthread_mutex_lock(&pool.lock);  // the last tasks of a job whose caller sleeps
        pthread_cond_broadcast(&pool.finished);
        pthread_mutex_unlock(&pool.lock);
    }
    task->finished = 0;
    return -1;
}

static void run_from(job_t *job, uint32_t gen, int worker) {
    kvf_body body;
    void *ctx;
    long end;
    const long first = claim(job, gen, &end, &body, &ctx);
    if (first < 0) return;
    kvf_task task = {job, gen, worker, first + 1, end, 0};
    body(ctx, &task, first, worker);
}

static void *pool_thread(void *arg) {
    // this thread is worker index + 1; it starts from the generation published when it was
    // created, so the job its creator publishes next (maybe before it runs) is new to it
    const int index = (int)((uintptr_t)arg & 0xffff);
    uint32_t seen = (uint32_t)((uintptr_t)arg >> 32);
    for (;;) {
        uint32_t g = atomic_load(&pool.published);
        if (g == seen) {
            const long until = now_ns() + POOL_SPIN_NS;
            for (int k = 1; (g = atomic_load(&pool.published)) == seen; k++) {
                cpu_relax();
                if (k % 64 == 0) {
                    if (now_ns() > until) break;
                    sched_yield();  // a no-op on an idle core; the core to others when they wait
                }
            }
        }
        if (g == seen) {
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((g = atomic_load(&pool.published)) == seen)
                pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = g;
        if (index + 1 >= atomic_load_explicit(&pool.job.threads, memory_order_relaxed)) continue;  // not asked (a failed claim would do too)
        const long stall = atomic_load_explicit(&pool.stall_us, memory_order_relaxed);
        if (stall > 0) {
            atomic_store(&pool.stalling, 1);
            usleep((useconds_t)stall);
            atomic_store(&pool.stalling, 0);
        }
        run_from(&pool.job, g, index + 1);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    // the child has none of the parent's threads: start again (the caller alone still
    // completes every job, so even a pool thread counted here and gone would stall nothing)
    pthread_mutex_init(&pool.submit, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.finished, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.started, 0);
}

__attribute__((constructor)) static void pool_init(void) {
    pthread_atfork(NULL, NULL, after_fork_in_child);
}

// Starts pool threads until `want` run (or the OS refuses one); called holding `submit`.
static void grow(int want) {
    if (want > MAX_THREADS - 1) want = MAX_THREADS - 1;
    while (atomic_load(&pool.started) < want) {
        const int index = atomic_load(&pool.started);
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const uintptr_t arg = (uintptr_t)atomic_load(&pool.published) << 32 | (uintptr_t)index;
        const int rc = pthread_create(&t, &attr, pool_thread, (void *)arg);
        pthread_attr_destroy(&attr);
        if (rc != 0) return;
        atomic_fetch_add(&pool.started, 1);
    }
}

static int run_alone(long n, kvf_body body, void *ctx) {
    job_t job = {.n = n, .body = body, .ctx = ctx};
    atomic_store(&job.next, ((uint64_t)1 << 32) | (uint64_t)n);  // all claimed by the caller
    atomic_store(&job.done, 0);
    kvf_task task = {&job, 1, 0, 1, n, 0};
    body(ctx, &task, 0, 0);
    return 0;
}

int kvf_parallel(long n, int threads, kvf_body body, void *ctx) {
    if (n < 0 || n > UINT32_MAX - 1 || body == NULL) return -1;
    if (n == 0) return 0;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || n == 1 || pthread_mutex_trylock(&pool.submit) != 0)
        return run_alone(n, body, ctx);
    grow(threads - 1);
    job_t *job = &pool.job;
    job->n = n;
    job->body = body;
    job->ctx = ctx;
    atomic_store_explicit(&job->threads, threads, memory_order_relaxed);
    atomic_store_explicit(&job->done, 0, memory_order_relaxed);
    const uint32_t gen = ++pool.gen ? pool.gen : ++pool.gen;  // 0 is never a generation
    atomic_store_explicit(&job->next, (uint64_t)gen << 32, memory_order_release);
    atomic_store(&pool.published, gen);  // seq_cst: pairs with a sleeper's count, then check
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    run_from(job, gen, 0);
    // What is left is tasks other threads claimed and are running, or were descheduled in.
    // Spin a little, then sleep: a sleeping caller leaves its core idle, and the OS moves a
    // descheduled pool thread there at once (a spinning or yielding one would keep it busy).
    const long until = now_ns() + CALLER_SPIN_NS;
    for (int k = 1; atomic_load(&job->done) < n; k++) {
        cpu_relax();
        if (k % 64 == 0 && now_ns() > until) {
            pthread_mutex_lock(&pool.lock);
            atomic_store(&job->waiting, 1);  // seq_cst: pairs with the last task's count, then check
            while (atomic_load(&job->done) < n) pthread_cond_wait(&pool.finished, &pool.lock);
            atomic_store(&job->waiting, 0);
            pthread_mutex_unlock(&pool.lock);
        }
    }
    pthread_mutex_unlock(&pool.submit);
    return 0;
}

int kvf_pool_threads(void) {
    return atomic_load(&pool.started);
}

// Self-test (tests/unit/test_kernels_thread_pool.py): runs n tasks that each record the
// worker that ran them (workers[i]: 0 for the caller, 1000 + w for a task run twice), each
// taking task_us microseconds. With stall_us > 0 the pool threads pause that long before they
// claim, and the caller starts only once one of them is in that pause (up to stall_us): the
// return is 1 when the call ended while a pool thread was still paused (it did not wait for
// it), 0 if not, -1 on bad arguments.
typedef struct {
    int *workers;
    long task_us, stall_us;
} selftest_ctx;

static void selftest_body(void *vctx, kvf_task *task, long i, int worker) {
    selftest_ctx *c = vctx;
    int *workers = c->workers;
    const long task_us = c->task_us;
    if (worker == 0 && c->stall_us > 0)
        for (long waited = 0; !atomic_load(&pool.stalling) && waited < c->stall_us; waited += 100)
            usleep(100);
    for (; i >= 0; i = kvf_next(task)) {
        if (task_us > 0) usleep((useconds_t)task_us);
        workers[i] = workers[i] < 0 ? worker : 1000 + worker;
    }
}

int kvf_pool_selftest(long n, int threads, int *workers, long task_us, long stall_us) {
    if (n < 0 || workers == NULL) return -1;
    for (long i = 0; i < n; i++) workers[i] = -1;
    selftest_ctx c = {workers, task_us, stall_us};
    atomic_store(&pool.stall_us, stall_us);
    const int rc = kvf_parallel(n, threads, selftest_body, &c);
    const int stalled = stall_us > 0 && atomic_load(&pool.stalling);
    atomic_store(&pool.stall_us, 0);
    return rc != 0 ? -1 : stalled;
}
