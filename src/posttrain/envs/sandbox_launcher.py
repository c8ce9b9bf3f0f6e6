# posttrain.envs.sandbox: the launcher of one run
import ctypes, marshal, os, resource, signal, sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x20000, 0x8000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_GET_SECCOMP, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS = 1, 21, 22, 38
SECCOMP_MODE_FILTER = 2
# Landlock's system calls have the same numbers on every architecture
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_ABI1 = (1 << 13) - 1                                  # every right Landlock's first version knows
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15   # ABI 2, 3, 5
FS_FILE = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # the rights a file's rule may hold
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2                      # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2           # ABI 6
# seccomp: per architecture, AUDIT_ARCH_* and socket()'s number; io_uring_setup, _enter and
# _register are 425-427 everywhere
SECCOMP_ARCH = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
IO_URING = (425, 426, 427)
AF_INET, AF_INET6, EPERM = 2, 10, 1
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x50000, 0x7FFF0000
BPF_LOAD, BPF_JEQ, BPF_JGE, BPF_RET = 0x20, 0x15, 0x35, 0x06

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.unshare.argtypes = [ctypes.c_int]
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def checked(result, what):
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, what + ": " + os.strerror(err))
    return result


def syscall(number, *args, what):
    # every argument as a long: a variadic int would leave the register's upper half undefined
    return checked(libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) for a in args]), what)


def prctl(option, value, what):
    checked(libc.prctl(option, value, 0, 0, 0), what)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)


def report(fd, *words):
    os.write(fd, (" ".join(str(w).replace("\n", " ") for w in words) + "\n").encode("utf-8", "replace"))


def enter_namespaces(network_namespace, done):
    """New user, mount, IPC and PID (for the next child) namespaces, and a network namespace
    unless the user opted in to network; `done` records each that worked."""
    uid, gid = os.getuid(), os.getgid()
    checked(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    # the same ids inside as outside, but never root: a non-root id loses every capability at exec
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", "%d %d 1" % (uid or 1000, uid))
    write("/proc/self/gid_map", "%d %d 1" % (gid or 1000, gid))
    done["user_namespace"] = True
    steps = [(CLONE_NEWNS, "mount_namespace"), (CLONE_NEWIPC, "ipc_namespace"), (CLONE_NEWPID, "pid_namespace")]
    if network_namespace:
        steps.append((CLONE_NEWNET, "network_namespace"))
    for flag, name in steps:
        checked(libc.unshare(flag), "unshare for a " + name.replace("_", " "))
        done[name] = True
    # mounts made from now on stay in this mount namespace
    checked(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making / a private mount")


def mount_tmpfs(path, size):
    # nr_inodes too: an inode costs kernel memory that size does not count
    options = "size=%d,nr_inodes=%d,mode=0700" % (size, max(size // 4096, 256))
    checked(libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode()),
            "mounting a tmpfs on " + path)


def landlock_abi():
    return max(libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), ctypes.c_long(0), ctypes.c_long(0),
                            ctypes.c_long(LANDLOCK_CREATE_RULESET_VERSION)), 0)


def restrict_paths(abi, rules, deny_tcp):
    """Landlock: only `rules` ((path, writable) pairs: read and execute, or every right) open;
    no TCP bind or connect when deny_tcp; no signal and no abstract Unix socket outside."""
    handled = FS_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | \
        (FS_IOCTL_DEV if abi >= 5 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if deny_tcp and abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = RulesetAttr(handled, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8   # the struct as this ABI knows it
    ruleset = syscall(LANDLOCK_CREATE_RULESET, ctypes.addressof(attr), size, 0, what="landlock_create_ruleset")
    try:
        for path, writable in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                allowed = handled if writable else FS_READ
                if os.fstat(fd).st_mode & 0o170000 != 0o040000:   # not a directory
                    allowed &= FS_FILE
                rule = PathBeneathAttr(allowed & handled, fd)
                syscall(LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.addressof(rule), 0,
                        what="landlock_add_rule(" + path + ")")
            finally:
                os.close(fd)
        syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0, what="landlock_restrict_self")
    finally:
        os.close(ruleset)


def forbid_sockets():
    """seccomp: socket() only for AF_INET and AF_INET6, which the network namespace and Landlock
    contain; the other families reach past namespaces (a Unix socket by its path, vsock).
    No io_uring: it can open sockets past seccomp. Instructions: (code, jump if true, if false, k)."""
    machine = os.uname().machine
    arch, socket_number = SECCOMP_ARCH[machine]
    deny = RET_ERRNO | EPERM
    program = [(BPF_LOAD, 0, 0, 4),                       # the architecture
               (BPF_JEQ, 1, 0, arch),
               (BPF_RET, 0, 0, RET_KILL_PROCESS),         # a foreign ABI (32-bit calls)
               (BPF_LOAD, 0, 0, 0)]                       # the system call's number
    if machine == "x86_64":
        program += [(BPF_JGE, 0, 1, 0x40000000), (BPF_RET, 0, 0, deny)]   # the x32 ABI's calls
    for number in IO_URING:
        program += [(BPF_JEQ, 0, 1, number), (BPF_RET, 0, 0, deny)]
    program += [(BPF_JEQ, 0, 4, socket_number),
                (BPF_LOAD, 0, 0, 16),                     # socket()'s address family (args[0], low half)
                (BPF_JEQ, 2, 0, AF_INET),
                (BPF_JEQ, 1, 0, AF_INET6),
                (BPF_RET, 0, 0, deny),
                (BPF_RET, 0, 0, RET_ALLOW)]
    filters = (SockFilter * len(program))(*[SockFilter(*instruction) for instruction in program])
    fprog = SockFprog(len(program), filters)
    checked(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp")


def run_program(config, status_fd):
    """The forked child: limits, walls, then exec Python on main.py. Never returns."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.setsid()   # its own session and process group: kill(0, ...) reaches nothing outside
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")   # the launcher killed: so is the program
        if config["pid_max"]:   # root: the kernel ignores RLIMIT_NPROC; bound the PID namespace instead
            write("/proc/sys/kernel/pid_max", str(config["pid_max"]))
        for which, value in config["rlimits"]:
            resource.setrlimit(which, (value, value))
        os.chdir(config["work"])
        prctl(PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")   # Landlock and seccomp need it
        if config["landlock"]:
            restrict_paths(config["landlock"], config["rules"], not config["network"])
        if config["seccomp"] and not config["network"]:
            forbid_sockets()
        os.execve(config["python"], config["argv"], config["env"])
    except BaseException as err:
        report(status_fd, "refused", "%s: %s" % (type(err).__name__, err))
    finally:
        os._exit(127)


CHILD = 0


def stop(signum, frame):
    """SIGTERM from the caller: kill the program (its PID namespace goes with it), then reap and report."""
    if not CHILD:
        os._exit(1)
    for kill in (os.kill, os.killpg):
        try:
            kill(CHILD, signal.SIGKILL)
        except OSError:
            pass


def launch(config, status_fd):
    global CHILD
    os.set_inheritable(status_fd, False)   # the program must not inherit the report's pipe
    # the caller killed: so is the launcher, and with it the program (its own PR_SET_PDEATHSIG)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "PR_SET_PDEATHSIG")
    if os.getppid() != config["caller"]:   # it died before that
        return
    try:
        if config["namespaces"]:
            enter_namespaces(not config["network"], {})
            mount_tmpfs(config["work"], config["dir_bytes"])
            mount_tmpfs("/dev/shm", config["shm_bytes"])
        for name, data in config["files"].items():
            path = os.path.join(config["work"], name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
    except OSError as err:
        report(status_fd, "refused", err)
        return
    signal.signal(signal.SIGTERM, stop)
    child = os.fork()
    if child == 0:
        run_program(config, status_fd)
    CHILD = child
    # wait without reaping, so that its pid (its process group's id) is not reused while the rest
    # of its group is killed: in a PID namespace they are gone already, without one they are not
    os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
    try:
        os.killpg(child, signal.SIGKILL)
    except OSError:
        pass
    CHILD = 0   # reaped next: its pid may be reused, a late SIGTERM must not kill by it
    _, status, usage = os.wait4(child, 0)
    report(status_fd, "exit", os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime)


def probe(scratch, floor):
    """What this kernel allows, as a marshalled dict on stdout (for isolation_report)."""
    found = {"user_namespace": False, "mount_namespace": False, "ipc_namespace": False, "pid_namespace": False,
             "network_namespace": False, "tmpfs": False, "pid_max": False, "landlock": landlock_abi(),
             "seccomp": os.uname().machine in SECCOMP_ARCH and libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0) >= 0,
             "problem": ""}
    try:
        enter_namespaces(True, found)
        mount_tmpfs(scratch, 1 << 16)
        found["tmpfs"] = True
        child = os.fork()
        if child == 0:   # the first process of the new PID namespace: is it PID 1, may it set pid_max?
            code = 1 if os.getpid() == 1 else 0
            try:
                write("/proc/sys/kernel/pid_max", floor)
                code |= 2
            except OSError:
                pass
            os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        found["pid_namespace"] = bool(code & 1)
        found["pid_max"] = bool(code & 2)
    except OSError as err:
        found["problem"] = str(err)
    sys.stdout.buffer.write(marshal.dumps(found))


if __name__ == "__main__":     # as a program only: importing this module runs nothing
    if sys.argv[1] == "probe":   # run from this source: python -I -S -c LAUNCHER probe DIR FLOOR
        probe(sys.argv[2], sys.argv[3])
    else:                        # run by START, which puts the run's config in CONFIG; the status pipe argv[2]
        launch(globals()["CONFIG"], int(sys.argv[2]))
