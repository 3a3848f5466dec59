# The warm-pool zygote: runs as the program of a sandbox (all namespaces,
# rlimits, seccomp already applied) and forks one child per request, so a run
# costs a fork instead of an interpreter start. Protocol on fd 3 (a unix
# stream socket): request = u32 length + body, with the run's stdin, stdout
# and stderr pipes attached (SCM_RIGHTS); reply = 9 bytes
# [1, wait status i32, 0 i32]. Leftover processes are killed before replying.
import atexit, ctypes, os, resource, select, shutil, signal, socket, struct, sys, time, traceback, types

BASH = "@BASH@"
PR_SET_DUMPABLE = 4
libc = ctypes.CDLL(None)
# Runs share our uid: keep /proc/<zygote>/mem and friends closed to them.
libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
sock = socket.socket(fileno=3)
# A file over RLIMIT_FSIZE is an error (EFBIG) for us, not a fatal signal.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def recv_exact(n, head=b""):
    buf = bytearray(head)
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            os._exit(0)
        buf += chunk
    return bytes(buf)


def clean():
    for d in ("/work", "/tmp", "/dev/shm"):
        for name in os.listdir(d):
            p = os.path.join(d, name)
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.unlink(p)
            except OSError:
                pass


def child(lang, mem, code, fds):
    rc = 1
    try:
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        os.setsid()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        os.closerange(3, 65536)
        if mem:
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        os.chdir("/work")
        if lang == 1:
            # The script lives in a memfd: nothing extra in /work or /tmp.
            fd = os.memfd_create("main.sh", 0)
            view = memoryview(code)
            while view:
                view = view[os.write(fd, view) :]
            os.lseek(fd, 0, os.SEEK_SET)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            os.execv(BASH, ["bash", "/proc/self/fd/%d" % fd])
        main = types.ModuleType("__main__")
        main.__file__ = "/code/main.py"
        sys.modules["__main__"] = main
        sys.argv = ["/code/main.py"]
        exec(compile(code, "/code/main.py", "exec"), main.__dict__)
        rc = 0
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    os._exit(rc & 0xFF)


# Ready byte, with an O_PATH handle on /work so the host can read fetched
# files beneath it (RESOLVE_BENEATH) without /proc/PID/root.
socket.send_fds(sock, [b"R"], [os.open("/work", os.O_PATH | os.O_DIRECTORY)])
while True:
    head, fds, _, _ = socket.recv_fds(sock, 4, 3)
    if not head:
        os._exit(0)
    (n,) = struct.unpack("<I", recv_exact(4, head))
    body = recv_exact(n)
    lang, flags, timeout_ms, mem, clen = struct.unpack_from("<BBIQI", body, 0)
    off = 18
    code = body[off : off + clen]
    off += clen
    (nfiles,) = struct.unpack_from("<I", body, off)
    off += 4
    if flags & 1:
        clean()
    # A file that cannot be written (disk full, a directory in the way) is
    # the run's failure, reported on its stderr; never the zygote's.
    failed = None
    for _ in range(nfiles):
        (plen,) = struct.unpack_from("<I", body, off)
        path = body[off + 4 : off + 4 + plen].decode()
        off += 4 + plen
        (dlen,) = struct.unpack_from("<I", body, off)
        data = body[off + 4 : off + 4 + dlen]
        off += 4 + dlen
        if failed:
            continue
        try:
            full = os.path.join("/work", path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "wb") as f:
                f.write(data)
        except OSError as e:
            failed = "cannot write file %r: %s\n" % (path, e.strerror or e)
    if failed:
        try:
            os.write(fds[2], failed.encode())
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
        sock.sendall(struct.pack("<Bii", 1, 1 << 8, 0))
        continue
    pid = os.fork()
    if pid == 0:
        child(lang, mem, code, fds)
    for fd in fds:
        os.close(fd)
    # Wait with the run's timeout; on expiry kill it (and, below, all it
    # started) and say so, so the worker survives a timeout.
    timed_out = 0
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    # The host sends nothing during a run: the socket turning readable
    # means it closed (the host process died, e.g. SIGKILL). Then the run
    # must not live on until its timeout: kill everything and leave.
    poller.register(sock.fileno(), select.POLLIN)
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        left = deadline - time.monotonic()
        events = poller.poll(max(0, int(left * 1000) + 1)) if left > 0 else []
        if any(fd == pidfd for fd, _ in events):
            break
        if events:
            try:
                peek = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                peek = None
            except OSError:
                peek = b""
            if peek == b"":
                for _ in range(1000):
                    try:
                        os.kill(-1, signal.SIGKILL)
                    except ProcessLookupError:
                        break
                os._exit(0)
            poller.unregister(sock.fileno())
            continue
        if time.monotonic() >= deadline:
            timed_out = 1
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
    os.close(pidfd)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            status = 0
            break
    # Kill what the run left until nothing is left to signal (kill(-1) can
    # miss a process forked while it walks the list; zombies count until
    # init reaps them). Still not clean: exit, and the worker is replaced.
    for _ in range(1000):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(0.0005)
    else:
        os._exit(1)
    sock.sendall(struct.pack("<Bii", 1, status, timed_out))
