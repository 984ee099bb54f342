/*
 * The code between fork() and the untrusted program: every isolation step of one run, in C.
 *
 * A run is forked from a warm Python interpreter, and every page Python touches in the child is a
 * copy-on-write fault; doing these steps as plain system calls keeps a warm run close to the cost of
 * the fork itself. The child arrives as PID 1 of a fresh PID namespace. In order it:
 *   starts its own session (so kill(0, ...) cannot reach the host's process group),
 *   takes new mount and IPC namespaces, binds the run's tmpfs as the workdir, /tmp and /dev/shm,
 *   mounts a /proc for its PID namespace, joins its cgroups (descriptors opened by the host),
 *   sets its rlimits, opens stdin, drops to the run user, sets no_new_privs, loads the seccomp filter,
 *   puts stdio in place and closes every other descriptor,
 * then execs the program, or returns to Python for a warm-interpreter run.
 *
 * The plan arrives as a memfd of NUL-terminated fields (see `encode_plan` in child.py):
 *   run_dir, workdir, uid, gid, cpu_s, nofile, fsize, mode ("exec" | "python"),
 *   argc, argv..., envc, env..., shadowc, (alias, target)..., then for "python" the script path.
 * A shadow pair re-binds a read-only path that lives under /tmp (a checkout in /tmp, say) from its
 * alias in the root view, since the run's own /tmp covers it.
 * On any failure the child writes "step: reason" to the status pipe and exits 125.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SETUP_FAILED_EXIT 125
#define STATUS_FD 3
#define MAX_PLAN_BYTES (1 << 20)
#define MAX_ARGS 4096
#define MAX_CGROUP_FDS 16

static int status_fd = -1;

static void fail_with(const char *step, const char *reason) {
    char message[1024];
    int length = snprintf(message, sizeof(message), "%s: %s", step, reason);
    if (length > 0 && status_fd >= 0) {
        ssize_t ignored = write(status_fd, message, (size_t)length);
        (void)ignored;
    }
    _exit(SETUP_FAILED_EXIT);
}

static void fail(const char *step) { fail_with(step, strerror(errno)); }

struct reader {
    char *cursor, *end;
};

static char *next_field(struct reader *reader) {
    if (reader->cursor >= reader->end) fail_with("plan", "truncated");
    char *field = reader->cursor;
    char *nul = memchr(field, '\0', (size_t)(reader->end - field));
    if (nul == NULL) fail_with("plan", "unterminated field");
    reader->cursor = nul + 1;
    return field;
}

static unsigned long long next_number(struct reader *reader) {
    char *field = next_field(reader), *rest;
    errno = 0;
    unsigned long long value = strtoull(field, &rest, 10);
    if (errno != 0 || *rest != '\0' || rest == field) fail_with("plan", "bad number");
    return value;
}

static char **next_strings(struct reader *reader) {
    unsigned long long count = next_number(reader);
    if (count > MAX_ARGS) fail_with("plan", "too many strings");
    char **strings = calloc(count + 1, sizeof(char *));
    if (strings == NULL) fail("plan");
    for (unsigned long long i = 0; i < count; i++) strings[i] = next_field(reader);
    return strings;
}

static char *read_plan(int plan_fd, size_t *length) {
    struct stat info;
    if (fstat(plan_fd, &info) != 0) fail("plan");
    if (info.st_size <= 0 || info.st_size > MAX_PLAN_BYTES) fail_with("plan", "bad size");
    char *plan = malloc((size_t)info.st_size);
    if (plan == NULL) fail("plan");
    size_t done = 0;
    while (done < (size_t)info.st_size) {
        ssize_t got = pread(plan_fd, plan + done, (size_t)info.st_size - done, (off_t)done);
        if (got <= 0) fail("plan");
        done += (size_t)got;
    }
    *length = done;
    return plan;
}

static void bind_into(const char *run_dir, const char *source, const char *target) {
    char path[4096];
    if (snprintf(path, sizeof(path), "%s/%s", run_dir, source) >= (int)sizeof(path)) fail_with(target, "path too long");
    if (mount(path, target, NULL, MS_BIND, NULL) != 0) fail(target);
}

static void make_dirs(const char *path) {
    char partial[4096];
    size_t length = strlen(path);
    if (length >= sizeof(partial)) fail_with(path, "path too long");
    memcpy(partial, path, length + 1);
    for (char *slash = strchr(partial + 1, '/'); slash != NULL; slash = strchr(slash + 1, '/')) {
        *slash = '\0';
        if (mkdir(partial, 0755) != 0 && errno != EEXIST) fail(partial);
        *slash = '/';
    }
    if (mkdir(partial, 0755) != 0 && errno != EEXIST) fail(partial);
}

static void set_limit(int resource, rlim_t soft, rlim_t hard, const char *name) {
    struct rlimit limit = {soft, hard};
    if (setrlimit(resource, &limit) != 0) fail(name);
}

static PyObject *enter(PyObject *module, PyObject *args) {
    int plan_fd;
    PyObject *fd_tuple;
    Py_buffer bpf;
    if (!PyArg_ParseTuple(args, "iO!y*", &plan_fd, &PyTuple_Type, &fd_tuple, &bpf)) return NULL;
    Py_ssize_t fd_count = PyTuple_GET_SIZE(fd_tuple);
    if (fd_count < 3 || fd_count > 3 + MAX_CGROUP_FDS) {
        PyBuffer_Release(&bpf);
        PyErr_SetString(PyExc_ValueError, "expected stdout, stderr and status descriptors, then cgroup ones");
        return NULL;
    }
    int fds[3 + MAX_CGROUP_FDS];
    for (Py_ssize_t i = 0; i < fd_count; i++) {
        fds[i] = (int)PyLong_AsLong(PyTuple_GET_ITEM(fd_tuple, i));
        if (PyErr_Occurred()) {
            PyBuffer_Release(&bpf);
            return NULL;
        }
    }
    /* From here on this process is the run: failures exit through the status pipe, never back. */
    status_fd = fds[2];
    size_t plan_length;
    char *plan = read_plan(plan_fd, &plan_length);
    close(plan_fd);
    struct reader reader = {plan, plan + plan_length};
    const char *run_dir = next_field(&reader);
    const char *workdir = next_field(&reader);
    uid_t uid = (uid_t)next_number(&reader);
    gid_t gid = (gid_t)next_number(&reader);
    rlim_t cpu_s = next_number(&reader), nofile = next_number(&reader), fsize = next_number(&reader);
    const char *mode = next_field(&reader);
    int warm_python = strcmp(mode, "python") == 0;
    if (!warm_python && strcmp(mode, "exec") != 0) fail_with("plan", "unknown mode");
    char **argv = next_strings(&reader);
    char **envp = next_strings(&reader);
    char **shadows = next_strings(&reader);
    const char *script = warm_python ? next_field(&reader) : NULL;
    if (!warm_python && argv[0] == NULL) fail_with("plan", "empty argv");

    prctl(PR_SET_NAME, "tether-run", 0, 0, 0);
    if (setsid() < 0) fail("setsid");
    if (unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0) fail("unshare mount+ipc");
    bind_into(run_dir, "work", workdir);
    bind_into(run_dir, "tmp", "/tmp");
    bind_into(run_dir, "shm", "/dev/shm");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0) fail("mount /proc");
    for (char **pair = shadows; pair[0] != NULL && pair[1] != NULL; pair += 2) {
        make_dirs(pair[1]);
        if (mount(pair[0], pair[1], NULL, MS_BIND | MS_REC, NULL) != 0) fail(pair[1]);
    }
    for (Py_ssize_t i = 3; i < fd_count; i++) {
        if (write(fds[i], "0", 1) != 1) fail("join cgroup");
    }
    set_limit(RLIMIT_CORE, 0, 0, "RLIMIT_CORE");
    set_limit(RLIMIT_CPU, cpu_s, cpu_s + 1, "RLIMIT_CPU");
    set_limit(RLIMIT_NOFILE, nofile, nofile, "RLIMIT_NOFILE");
    set_limit(RLIMIT_FSIZE, fsize, fsize, "RLIMIT_FSIZE");
    char stdin_path[4096];
    if (snprintf(stdin_path, sizeof(stdin_path), "%s/meta/stdin", run_dir) >= (int)sizeof(stdin_path))
        fail_with("stdin", "path too long");
    int stdin_fd = open(stdin_path, O_RDONLY | O_CLOEXEC);
    if (stdin_fd < 0) fail("open stdin");
    if (chdir(workdir) != 0) fail("chdir workdir");
    if (setgroups(0, NULL) != 0) fail("setgroups");
    if (setresgid(gid, gid, gid) != 0) fail("setresgid");
    if (setresuid(uid, uid, uid) != 0) fail("setresuid");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail("no_new_privs");
    if (bpf.len > 0) {
        struct sock_fprog program = {
            .len = (unsigned short)(bpf.len / (Py_ssize_t)sizeof(struct sock_filter)),
            .filter = (struct sock_filter *)bpf.buf,
        };
        if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program, 0, 0) != 0) fail("seccomp");
    }
    if (dup2(stdin_fd, 0) < 0 || dup2(fds[0], 1) < 0 || dup2(fds[1], 2) < 0 || dup2(status_fd, STATUS_FD) < 0)
        fail("dup2");
    status_fd = STATUS_FD;
    if (syscall(SYS_close_range, STATUS_FD + 1, ~0U, 0) != 0) {
        for (int fd = STATUS_FD + 1; fd < 65536; fd++) close(fd);
    }
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (!warm_python) {
        close(STATUS_FD);
        execve(argv[0], argv, envp);
        char message[1024];
        int length = snprintf(message, sizeof(message), "cannot execute %s: %s\n", argv[0], strerror(errno));
        if (length > 0) {
            ssize_t ignored = write(2, message, (size_t)length);
            (void)ignored;
        }
        _exit(127);
    }
    PyObject *environment = PyList_New(0);
    if (environment == NULL) fail_with("python", "out of memory");
    for (char **entry = envp; *entry != NULL; entry++) {
        PyObject *item = PyUnicode_DecodeFSDefault(*entry);
        if (item == NULL || PyList_Append(environment, item) != 0) fail_with("python", "bad environment");
        Py_DECREF(item);
    }
    PyObject *result = Py_BuildValue("(sN)", script, environment);
    if (result == NULL) fail_with("python", "out of memory");
    return result;
}

/* Small wrappers the fork server needs on its per-run path, so that it carries no ctypes. */
static PyObject *py_unshare(PyObject *module, PyObject *arg) {
    int flags = (int)PyLong_AsLong(arg);
    if (PyErr_Occurred()) return NULL;
    if (unshare(flags) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *py_setns(PyObject *module, PyObject *args) {
    int fd, nstype;
    if (!PyArg_ParseTuple(args, "ii", &fd, &nstype)) return NULL;
    if (setns(fd, nstype) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *py_set_process_name(PyObject *module, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    if (prctl(PR_SET_NAME, name, 0, 0, 0) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/*
 * The fork server's loop (see forkserver.py), in C: between two forks the server runs no Python, so it
 * writes almost none of the pages its children share with it (each such write is a copy-on-write fault
 * in the server or the child), and the child leaves through a plain fork(), not os.fork(): Python's
 * at-fork handlers (threading re-creates its locks and thread table, random reseeds) would touch
 * hundreds of shared pages in every run. The server is single-threaded, so there is no lock or thread
 * for them to reset; `random` is reseeded by the warm runner, as a fresh interpreter would seed it.
 */
#define MAX_RUN_FDS 16
#define EXIT_REPORT_BYTES (sizeof(int) + 2 * sizeof(double))

static int receive_run_fds(int channel, int *fds) {
    char byte;
    struct iovec io = {.iov_base = &byte, .iov_len = 1};
    union {
        char buffer[CMSG_SPACE(MAX_RUN_FDS * sizeof(int))];
        struct cmsghdr align;
    } control;
    struct msghdr message = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = control.buffer,
                             .msg_controllen = sizeof(control.buffer)};
    ssize_t got;
    do got = recvmsg(channel, &message, 0);
    while (got < 0 && errno == EINTR);
    if (got <= 0) return 0;
    int count = 0;
    for (struct cmsghdr *header = CMSG_FIRSTHDR(&message); header != NULL; header = CMSG_NXTHDR(&message, header)) {
        if (header->cmsg_level != SOL_SOCKET || header->cmsg_type != SCM_RIGHTS) continue;
        int n = (int)((header->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < n && count < MAX_RUN_FDS; i++) memcpy(&fds[count++], CMSG_DATA(header) + i * sizeof(int), sizeof(int));
    }
    if (message.msg_flags & MSG_CTRUNC) {  /* a request cut short is refused: the server ends */
        for (int i = 0; i < count; i++) close(fds[i]);
        return 0;
    }
    return count;
}

static int send_pidfd(int channel, int pidfd) {
    char tag = 'p';
    struct iovec io = {.iov_base = &tag, .iov_len = 1};
    union {
        char buffer[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    memset(&control, 0, sizeof(control));
    struct msghdr message = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = control.buffer,
                             .msg_controllen = sizeof(control.buffer)};
    struct cmsghdr *header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(header), &pidfd, sizeof(int));
    ssize_t sent;
    do sent = sendmsg(channel, &message, MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    return sent == 1 ? 0 : -1;
}

static PyObject *serve_forks(PyObject *module, PyObject *args) {
    int channel, own_pid_ns;
    if (!PyArg_ParseTuple(args, "ii", &channel, &own_pid_ns)) return NULL;
    int fds[MAX_RUN_FDS];
    for (;;) {
        int count = receive_run_fds(channel, fds);
        if (count == 0) Py_RETURN_NONE;
        if (unshare(CLONE_NEWPID) != 0) return PyErr_SetFromErrno(PyExc_OSError);
        pid_t pid = fork();
        if (pid == 0) {
            PyObject *run_fds = PyTuple_New(count);
            if (run_fds == NULL) _exit(SETUP_FAILED_EXIT);
            for (int i = 0; i < count; i++) PyTuple_SET_ITEM(run_fds, i, PyLong_FromLong(fds[i]));
            return run_fds;
        }
        int fork_errno = errno;
        if (setns(own_pid_ns, CLONE_NEWPID) != 0) return PyErr_SetFromErrno(PyExc_OSError);
        for (int i = 0; i < count; i++) close(fds[i]);
        if (pid < 0) {
            errno = fork_errno;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
        int sent = pidfd >= 0 ? send_pidfd(channel, pidfd) : -1;
        if (pidfd >= 0) close(pidfd);
        if (sent != 0) kill(pid, SIGKILL);  /* the zygote is gone or the run cannot be watched */
        int status;
        struct rusage usage;
        pid_t waited;
        do waited = wait4(pid, &status, 0, &usage);
        while (waited < 0 && errno == EINTR);
        if (waited < 0) return PyErr_SetFromErrno(PyExc_OSError);
        if (sent != 0) Py_RETURN_NONE;
        char report[EXIT_REPORT_BYTES];
        double user_s = (double)usage.ru_utime.tv_sec + (double)usage.ru_utime.tv_usec / 1e6;
        double system_s = (double)usage.ru_stime.tv_sec + (double)usage.ru_stime.tv_usec / 1e6;
        memcpy(report, &status, sizeof(int));
        memcpy(report + sizeof(int), &user_s, sizeof(double));
        memcpy(report + sizeof(int) + sizeof(double), &system_s, sizeof(double));
        ssize_t done;
        do done = send(channel, report, sizeof(report), MSG_NOSIGNAL);
        while (done < 0 && errno == EINTR);
        if (done != (ssize_t)sizeof(report)) Py_RETURN_NONE;
    }
}

static PyMethodDef methods[] = {
    {"serve_forks", (PyCFunction)serve_forks, METH_VARARGS,
     "serve_forks(channel_fd, own_pid_ns_fd) -> tuple[int, ...] | None\n\n"
     "The fork server's loop: for each request of descriptors on the channel, fork a run as PID 1 of a "
     "new PID namespace, answer its pidfd, then its wait status and CPU time. Returns None in the server "
     "once the channel closes, and the request's descriptors in each forked run."},
    {"unshare", (PyCFunction)py_unshare, METH_O, "unshare(flags): unshare(2)."},
    {"setns", (PyCFunction)py_setns, METH_VARARGS, "setns(fd, nstype): setns(2)."},
    {"set_process_name", (PyCFunction)py_set_process_name, METH_O, "Name the calling thread (15 bytes)."},
    {"enter", (PyCFunction)enter, METH_VARARGS,
     "enter(plan_fd, (stdout_fd, stderr_fd, status_fd, *cgroup_fds), seccomp_bpf) -> (script, env)\n\n"
     "Isolate the calling (freshly forked) process as a run. Execs the program and never returns, or, "
     "for a warm-Python plan, returns the script path and environment entries to run in-process."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tether.sandbox._enter",
    .m_doc = "Isolate a freshly forked run (see _enter.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__enter(void) { return PyModule_Create(&module); }
