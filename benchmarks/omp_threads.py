"""Why a trainer in a background thread (the LoRA studio's) runs slower on a CPU than the same loop in the main
thread: GNU OpenMP (the intra-op backend of the PyPI torch wheels on Linux) keeps one thread pool per thread
that starts a parallel region. Once two threads have done so, the process holds more OpenMP threads than cores
and libgomp stops spinning between regions (it sleeps and wakes instead), so every small op gets slower, in
every thread, the main thread included.

    python benchmarks/omp_threads.py [--iters 1500]

Each row runs the same small forward/backward loop (a 64x256 @ 256x256 matmul, relu, sum, backward) in the
thread named, in this order, in one process; `x first` is the row's time over the first row's. Run it alone:
other processes on the cores change the figures."""
import argparse, queue, threading, time

import torch


class Worker:
    "A long-lived thread that runs the functions it is given, one at a time (as a trainer thread does)."
    def __init__(self):
        self.q = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            f, out, done = self.q.get()
            out.append(f()); done.set()

    def run(self, f):
        out, done = [], threading.Event()
        self.q.put((f, out, done)); done.wait()
        return out[0]


def main(argv=None) -> list[tuple[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=1500)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    x, w = torch.randn(64, 256), torch.randn(256, 256, requires_grad=True)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(a.iters):
            (x @ w).relu().sum().backward()
        return time.perf_counter() - t0

    A, B = Worker(), Worker()
    rows = [("thread A, the first to run OpenMP", A.run(loop)), ("thread A again", A.run(loop)),
            ("thread B, a second thread", B.run(loop)), ("thread A, after B", A.run(loop)),
            ("the main thread", loop())]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, backend: "
          f"{'OpenMP' if 'OpenMP' in torch.__config__.parallel_info() else 'other'}")
    print(f"{'loop run in':36s} {'seconds':>8s} {'x first':>8s}")
    for name, s in rows:
        print(f"{name:36s} {s:8.3f} {s / rows[0][1]:8.2f}")
    return rows


if __name__ == "__main__":
    main()
