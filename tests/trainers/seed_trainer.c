/* A trainer in another language for `runner run` tests: plain C, no PyTorch.
 *
 * It trains n parameters with a deterministic AdamW-style update and writes seed-format
 * checkpoints (step_NNNNNN.bin: int32 step, int32 n, n f32 weights, n f32 m, n f32 v) into
 * $RUNNER_CKPT_DIR under a temp name, then renames them. It resumes from $RUNNER_RESUME_FROM
 * (refusing, exit 2, any $RUNNER_RESUME_FORMAT other than seed-bin) and appends each step's
 * loss to $RUNNER_RUN_DIR/loss.jsonl.
 *   SIGUSR1          -> checkpoint at the end of the step, keep going
 *   SIGTERM / SIGINT -> checkpoint at the end of the step, exit 0
 * Usage: seed_trainer TOTAL_STEPS N_PARAMS STEP_MS CKPT_EVERY
 * Fault injection (environment):
 *   TRAINER_CRASH_AT=k       exit 1 after step k when started without a checkpoint
 *   TRAINER_ALWAYS_CRASH_AT=k  exit 1 after step k on every start
 *   TRAINER_BAD_BIN_AT=k     at step k write a checkpoint 4 bytes short
 */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static volatile sig_atomic_t stop_flag = 0;
static volatile sig_atomic_t ckpt_flag = 0;

static void on_stop(int sig) { (void)sig; stop_flag = 1; }
static void on_ckpt(int sig) { (void)sig; ckpt_flag = 1; }

static int env_int(const char *name) {
    const char *v = getenv(name);
    return (v && *v) ? atoi(v) : -1;
}

static void write_ckpt(const char *dir, int32_t step, int32_t n, const float *w,
                       const float *m, const float *v, int short_by) {
    char tmp[4096], final_path[4096];
    /* .tmp-<name>-<pid>-<tag>: the runner cleans up leftovers of a writer that died */
    snprintf(tmp, sizeof tmp, "%s/.tmp-step_%06d.bin-%d-c", dir, step, (int)getpid());
    snprintf(final_path, sizeof final_path, "%s/step_%06d.bin", dir, step);
    FILE *f = fopen(tmp, "wb");
    if (!f) { perror(tmp); exit(4); }
    int32_t header[2] = {step, n};
    fwrite(header, sizeof header, 1, f);
    fwrite(w, sizeof(float), (size_t)n, f);
    fwrite(m, sizeof(float), (size_t)n, f);
    fwrite(v, sizeof(float), (size_t)n - (short_by ? 1 : 0), f);
    fflush(f);
    fsync(fileno(f));
    fclose(f);
    if (rename(tmp, final_path) != 0) { perror("rename"); exit(4); }
    printf("checkpoint step %d%s\n", step, short_by ? " (bad size)" : "");
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s TOTAL_STEPS N_PARAMS STEP_MS CKPT_EVERY\n", argv[0]);
        return 2;
    }
    int total = atoi(argv[1]);
    int32_t n = atoi(argv[2]);
    int step_ms = atoi(argv[3]);
    int every = atoi(argv[4]);
    const char *dir = getenv("RUNNER_CKPT_DIR");
    const char *resume = getenv("RUNNER_RESUME_FROM");
    const char *format = getenv("RUNNER_RESUME_FORMAT");
    const char *run_dir = getenv("RUNNER_RUN_DIR");
    char loss_path[4096] = "";
    if (run_dir && *run_dir) snprintf(loss_path, sizeof loss_path, "%s/loss.jsonl", run_dir);
    if (!dir || !*dir) { fprintf(stderr, "RUNNER_CKPT_DIR is not set\n"); return 2; }
    /* Check the format before reading a byte: a torch file parsed as a seed header gives
     * a nonsense step instead of an error. */
    if (resume && *resume && format && *format && strcmp(format, "seed-bin") != 0) {
        fprintf(stderr,
                "cannot resume from %s: its format is %s (RUNNER_RESUME_FORMAT), and this "
                "trainer reads only seed-bin checkpoints (step_NNNNNN.bin). Give it a run dir "
                "of its own (--run-dir) or one whose checkpoints it wrote\n",
                resume, format);
        return 2;
    }

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_ckpt;
    sigaction(SIGUSR1, &sa, NULL);

    float *w = calloc((size_t)n, sizeof(float));
    float *m = calloc((size_t)n, sizeof(float));
    float *v = calloc((size_t)n, sizeof(float));
    int32_t step = 0;
    for (int32_t i = 0; i < n; i++) w[i] = (float)(i % 7) * 0.25f;
    if (resume && *resume) {
        FILE *f = fopen(resume, "rb");
        if (!f) { perror(resume); return 5; }
        int32_t header[2];
        if (fread(header, sizeof header, 1, f) != 1 || header[1] != n) {
            fprintf(stderr, "bad resume file %s\n", resume);
            return 5;
        }
        step = header[0];
        if (fread(w, sizeof(float), (size_t)n, f) != (size_t)n ||
            fread(m, sizeof(float), (size_t)n, f) != (size_t)n ||
            fread(v, sizeof(float), (size_t)n, f) != (size_t)n) {
            fprintf(stderr, "short resume file %s\n", resume);
            return 5;
        }
        fclose(f);
    }
    printf("started at step %d resume=%s\n", step, (resume && *resume) ? resume : "none");
    fflush(stdout);

    int crash_at = (resume && *resume) ? -1 : env_int("TRAINER_CRASH_AT");
    int always_crash_at = env_int("TRAINER_ALWAYS_CRASH_AT");
    int bad_at = env_int("TRAINER_BAD_BIN_AT");
    const float lr = 0.01f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    struct timespec nap = {step_ms / 1000, (long)(step_ms % 1000) * 1000000L};

    while (step < total) {
        step++;
        double loss = 0.0;
        for (int32_t i = 0; i < n; i++) {
            float target = (float)((i * 31 + step) % 13) / 13.0f;
            float g = w[i] - target;
            loss += (double)g * g;
            m[i] = b1 * m[i] + (1 - b1) * g;
            v[i] = b2 * v[i] + (1 - b2) * g * g;
            float mh = m[i] / (1 - powf(b1, (float)step));
            float vh = v[i] / (1 - powf(b2, (float)step));
            w[i] -= lr * (mh / (sqrtf(vh) + eps) + 0.01f * w[i]);
        }
        printf("step %d loss %.6f\n", step, loss / n);
        fflush(stdout);
        if (*loss_path) {
            FILE *lf = fopen(loss_path, "a");
            if (lf) {
                fprintf(lf, "{\"step\": %d, \"loss\": %.9g}\n", step, loss / n);
                fclose(lf);
            }
        }
        while (nanosleep(&nap, &nap) == -1 && errno == EINTR) {}
        nap.tv_sec = step_ms / 1000;
        nap.tv_nsec = (long)(step_ms % 1000) * 1000000L;
        if (step == crash_at || step == always_crash_at) {
            fprintf(stderr, "boom: simulated crash after step %d\n", step);
            return 1;
        }
        if (step == bad_at) write_ckpt(dir, step, n, w, m, v, 1);
        else if ((every > 0 && step % every == 0) || ckpt_flag || stop_flag || step == total)
            write_ckpt(dir, step, n, w, m, v, 0);
        ckpt_flag = 0;
        if (stop_flag) {
            printf("stopping at step %d\n", step);
            fflush(stdout);
            return 0;
        }
    }
    printf("done at step %d\n", step);
    return 0;
}
