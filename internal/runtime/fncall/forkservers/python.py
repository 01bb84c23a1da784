# DSec's Python fork server: a pre-started interpreter that runs each
# request `python3 SCRIPT ARGS...` in a forked child, so that a call pays a
# fork instead of an interpreter's start-up. Started by the container
# backend as `python3 -c <this file> NAME` (its protocol is described in
# internal/runtime/container/forkserver.go): it listens on the abstract
# Unix socket NAME in the sandbox's network namespace, accepts exactly one
# connection (the edge's) and closes the listener.
#
# Protocol (SOCK_SEQPACKET, one message per datagram):
#   edge -> server: b"run\0" + NUL-separated fields: cwd, argc, argv... ;
#                   with SCM_RIGHTS stdin, stdout, stderr. The child keeps
#                   this server's environment (the exec's, by contract).
#   server -> edge: b"pid N" with SCM_RIGHTS a pidfd of the child, then
#                   b"exit S" (S: the wait status) once it has exited; or
#                   b"error MESSAGE" if the request could not be run; or
#                   b"nofork ERRNO MESSAGE" if fork failed (the sandbox's
#                   process or memory limit).
#
# It imports nothing a fresh interpreter does not have but _socket and gc,
# which the child drops from sys.modules, so the child starts from the
# state a fresh `python3 SCRIPT` reaches before running its first line.
import gc
import os
import sys
import _socket

# Imported now, for the child's exit, and dropped from sys.modules: the
# callbacks live in the interpreter, so the child's own `import atexit`
# registers where this module runs them.
import atexit as _atexit
del sys.modules["atexit"]

from stat import S_ISLNK as _S_ISLNK

# What this server adds to a fresh interpreter's modules.
_EXTRA = ("_socket", "gc")


def _fds(ancdata):
    fds = []
    for level, kind, data in ancdata:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            for i in range(0, usable, 4):
                fds.append(int.from_bytes(data[i:i + 4], sys.byteorder))
    return fds


def _exit_code(e):
    # What the interpreter does with an uncaught SystemExit.
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def _child(cwd, argv, fds):
    code = 70
    try:
        os.setsid()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        # Nothing of the server's reaches the program: not its connection
        # to the edge (closed by the caller), not what it was handed. Up to
        # the highest descriptor it may hold, even above a soft limit
        # lowered since it was opened (one close_range).
        os.closerange(3, max(os.sysconf("SC_OPEN_MAX"), *(fd + 1 for fd in fds)))
        os.chdir(cwd)
        for m in _EXTRA:
            sys.modules.pop(m, None)
        script = argv[1]
        sys.argv = argv[1:]
        sys.orig_argv = list(argv)
        # The interpreter's sys.path[0]: the script's directory, absolute,
        # after following the script itself if it is a symbolic link. In
        # string methods: every Python function a child runs for the
        # first time writes to (and so copies) the pages of its code.
        target = script if script.startswith("/") else cwd.rstrip("/") + "/" + script
        for _ in range(40):
            try:
                if not _S_ISLNK(os.lstat(target).st_mode):
                    break
                link = os.readlink(target)
            except OSError:
                break
            target = link if link.startswith("/") else target.rpartition("/")[0] + "/" + link
        sys.path[0] = target.rpartition("/")[0] or "/"
        main = type(sys)("__main__")
        loader = sys.modules["_frozen_importlib_external"].SourceFileLoader("__main__", script)
        main.__dict__.update(__file__=script, __cached__=None, __loader__=loader, __spec__=None,
                             __package__=None, __annotations__={}, __builtins__=sys.modules["builtins"])
        sys.modules["__main__"] = main
        code = 0
        try:
            with open(script, "rb") as f:
                source = f.read()
            exec(compile(source, script, "exec", dont_inherit=True), main.__dict__)
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException as e:
            # The first frame is this function's; the interpreter would not
            # show it.
            tb = e.__traceback__
            tb = tb.tb_next if tb is not None else None
            sys.excepthook(type(e), e.with_traceback(tb), tb)
            # An uncaught KeyboardInterrupt ends the interpreter by SIGINT.
            code = -1 if isinstance(e, KeyboardInterrupt) else 1
        # The interpreter's own exit: non-daemon threads, atexit, flush.
        threading = sys.modules.get("threading")
        if threading is not None:
            try:
                threading._shutdown()
            except BaseException:
                pass
        _atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except BaseException:
                code = 120
        if code == -1:
            import _signal
            _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
            os.kill(os.getpid(), _signal.SIGINT)
            code = 130
    finally:
        os._exit(code)


# Compiled (and run: it only computes) once before serving. The compiler
# and the evaluation loop set much up lazily on first use (parser tables,
# interned names, type attribute caches); done here, that is shared by
# every child instead of written, and so copied, by each one.
_WARM_UP = """
import sys
from os import path as _p

class Point:
    __slots__ = ("x", "y")

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __repr__(self):
        return f"Point({self.x!r}, {self.y:.2f})"

def solve(data, *args, key=None, **kw):
    total = 0
    seen = set()
    for i, v in enumerate(data):
        if v in seen or (key is not None and key(v) < 0):
            continue
        seen.add(v)
        total += v * i
    squares = [x * x for x in range(10) if x % 2]
    table = {str(k): v for k, v in zip("abc", squares)}
    try:
        ratio = total / len(data)
    except ZeroDivisionError as e:
        ratio = 0.0
    finally:
        pass
    with memoryview(b"") as m:
        pass
    lam = lambda a, b=2: a ** b
    return sorted(table.items(), key=lambda kv: kv[1]), ratio, lam(3), repr(Point(1, 2.5)), "%d-%s" % (1, "x"), " ".join(map(str, squares)).split(), max(squares), min(squares), sum(squares), abs(-1), divmod(7, 2), tuple(reversed(squares)), isinstance(total, int), [*squares, *args], {**kw}, not seen, -total, total // 3, total << 1, 1 if seen else 2, len(table), list(table.keys()), list(table.values()), table.get("z", 0), "abc".upper(), "ABC".lower(), "a,b".replace(",", ";"), "x".join(["a", "b"]), "  s ".strip(), "abc".startswith("a"), "abc".find("c"), int("12"), float("1.5"), str(1.5), bool(0), hash("k"), round(2.675, 2)

async def co():
    return [i async for i in agen()]

async def agen():
    yield 1

def gen(n):
    yield from range(n)

if __name__ == "__main__":
    print(solve([3, 1, 4, 1, 5, 9, 2, 6], key=abs), list(gen(3)), file=sys.stderr)
"""


def _warm_up():
    code = compile(_WARM_UP, "<warm-up>", "exec", dont_inherit=True)
    scope = {"__name__": "warm_up"}
    exec(code, scope)
    scope["solve"]([3, 1, 4, 1, 5, 9, 2, 6], key=abs)
    list(scope["gen"](3))


def main():
    os.chdir("/")
    _warm_up()
    # Nothing started later in this sandbox may read or change this process:
    # changing the effective group resets the dumpable flag to
    # fs.suid_dumpable (0), and a process that is not dumpable cannot be
    # ptraced, nor its /proc/PID/mem or fd read, without CAP_SYS_PTRACE.
    gid = os.getegid()
    os.setegid(65534 if gid != 65534 else 65533)
    os.setegid(gid)
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    listener.bind(b"\0" + sys.argv[1].encode())
    listener.listen(1)
    os.write(1, b"ready\n")
    fd, _ = listener._accept()
    listener.close()
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, fd)
    # The collector never visits what exists now: a child that ran a
    # collection over it would write (and so copy) every page it lives on.
    gc.freeze()
    space = _socket.CMSG_SPACE(3 * 4)
    while True:
        msg, anc, _, _ = conn.recvmsg(1 << 20, space)
        if not msg:
            os._exit(0)
        fds = _fds(anc)
        fields = msg.split(b"\0")
        try:
            if fields[0] != b"run" or len(fds) != 3:
                raise ValueError("bad request")
            cwd = os.fsdecode(fields[1])
            argc = int(fields[2])
            argv = [os.fsdecode(a) for a in fields[3:3 + argc]]
            if len(argv) != argc or len(argv) < 2:
                raise ValueError("argv needs the interpreter and a script")
        except (ValueError, IndexError) as e:
            for fd in fds:
                os.close(fd)
            conn.send(b"error " + str(e).encode())
            continue
        try:
            pid = os.fork()
        except OSError as e:
            # The sandbox's own limits (its pids cgroup: EAGAIN; its
            # memory: ENOMEM): the program's failure, not the server's.
            for fd in fds:
                os.close(fd)
            conn.send(b"nofork %d %s" % (e.errno or 0, os.strerror(e.errno or 0).encode()))
            continue
        if pid == 0:
            conn.close()
            _child(cwd, argv, fds)
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        conn.sendmsg([b"pid %d" % pid], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pidfd.to_bytes(4, sys.byteorder))])
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        conn.send(b"exit %d" % status)


main()
