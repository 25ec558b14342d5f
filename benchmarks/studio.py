"""The LoRA studio's overhead: steps per second of a run trained through the studio's web page against the
headless trainer it calls (`train_lora_run` for unit 4, `train_flux_lora` for unit 7), on the same base, images
and settings, each in its own fresh process, as a learner runs them:

- headless: a Python process that calls the trainer in its main thread (a notebook, `course lora train`);
- studio: a `course studio` server (`build_studio(...).launch()` on 127.0.0.1) driven as the page drives it:
  `/start` (through Gradio's own client), then `/status` over HTTP every `STATUS_EVERY_S` seconds with the page's
  session, as the page's timer sends it (it returns the status line and the live loss curve's data), until the run
  is done. The run trains in a
  process of its own (`Studio(train_in='process')`).

Runs alternate (headless, studio, headless, ...); the figures are the medians over `--repeat` pairs. Also printed:
the CPU a served studio uses while idle (no run, no page), which the training process shares the cores with.

    python benchmarks/studio.py                  # the small untrained bases of tests/test_studio.py, ~2 minutes
    python benchmarks/studio.py --steps 1000 --repeat 7    # ~13 minutes on 2 cores

On 2 CPU cores one run of either side varies by about 10% from the next (measured: headless unit 4 from 42 to
58 steps/s over 12 runs), so take several repeats before reading the ratio.

Target: the studio at most 5% below the headless trainer (the ratio printed is studio / headless). Run it alone:
other processes on the cores change the figures. Why both sides get a process of their own:
`benchmarks/omp_threads.py` shows that two threads running PyTorch in one process slow each other down on a
CPU, which a learner meets only by training in a notebook while a studio runs in the same kernel."""
import argparse, json, os, socket, statistics, subprocess, sys, tempfile, time, uuid
from pathlib import Path

HERE = Path(__file__).resolve()
SETTINGS = {"unet": {"rank": 4, "batch_size": 4, "prior_images": 0, "preview_every": 0},
            "flux": {"rank": 4, "alpha": 4.0, "batch_size": 4}}


def steps_per_s(history: list[dict], skip: int = 5) -> float:
    "Steps per second over the history after the first `skip` steps (warm-up)."
    h = history[skip:]
    return (len(h) - 1) / (h[-1]["seconds"] - h[0]["seconds"])


def prepare(root: Path):
    "A studio under `root` with 8 corner digits captioned 'a photo of sks digit', on `tiny_bases()`."
    from course_lib.flux import write_corner_folder
    from course_lib.studio import Studio, tiny_bases
    st = Studio(root, tiny_bases())
    if not st.images():
        st.add_images(sorted(write_corner_folder(root.parent/"digits", n=8, pixels=16).glob("*.png")))
        st.set_captions({n: "a photo of sks digit" for n in st.captions()})
    return st


def config(trainer: str, steps: int):
    from course_lib.studio import parse_settings
    s = {**SETTINGS[trainer], "steps": steps}
    if trainer == "flux": s["checkpoint_every"] = steps
    return parse_settings(trainer, s)


def child_headless(trainer: str, steps: int, work: Path) -> None:
    "The headless trainer in this process's main thread; prints the history's steps per second."
    import copy
    from course_lib.flux import train_flux_lora
    from course_lib.lora import train_lora_run
    st = prepare(work/"studio")
    cfg, base = config(trainer, steps), st.base(trainer)
    if trainer == "unet": run = train_lora_run(base, st.images_dir, cfg, work/"headless")
    else: run = train_flux_lora(copy.deepcopy(base), st.images_dir, cfg, work/"headless", progress=False)
    print(json.dumps({"steps_per_s": steps_per_s(run.history)}))


def child_serve(work: Path, port: int) -> None:
    "`course studio` on the prepared root (what `studio_main` launches), in the foreground."
    from course_lib.studio import build_studio, tiny_bases
    prepare(work/"studio")
    build_studio(work/"studio", tiny_bases()).launch(server_name="127.0.0.1", server_port=port, quiet=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def form(trainer: str, steps: int) -> list:
    "The Train tab's form values in the order `/start` takes them, with this benchmark's settings."
    from course_lib.studio import build_studio, tiny_bases
    demo = build_studio(Path(tempfile.mkdtemp())/"form", tiny_bases())
    comps = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) and
             b.elem_id.split("-")[0] in ("unet", "flux") and b.elem_id not in ("unet", "flux")]
    vals = {b.elem_id: b.value for b in comps}
    for k, v in {**SETTINGS[trainer], "steps": steps}.items(): vals[f"{trainer}-{k}"] = v
    if trainer == "flux": vals["flux-checkpoint_every"] = steps
    return list(vals.values())


def _status(session, port: int, session_hash: str) -> str:
    """The page's `/status` call over HTTP, as the browser's timer sends it: no Gradio client in between, and the
    page's `session_hash` (without one, Gradio builds the whole page's session state again for every call, which
    more than doubled the server's CPU time a call: 20 ms against 9 ms here)."""
    r = session.post(f"http://127.0.0.1:{port}/gradio_api/run/status",
                      json={"data": [], "session_hash": session_hash}, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]


def serve(work: Path):
    "`(process, port)`: a studio server on 127.0.0.1 (`--child serve`), once it accepts connections."
    port = free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    p = subprocess.Popen([sys.executable, str(HERE), "--child", "serve", "--work", str(work), "--port", str(port)],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.time()
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1): return p, port
        except OSError:
            if p.poll() is not None: raise RuntimeError(p.stderr.read().decode()[-2000:])
            if time.time() - t0 > 120: raise RuntimeError("the studio did not start in 120 s")
            time.sleep(0.3)


def idle_cpu(work: Path, seconds: float = 5.0) -> float:
    "Percent of one core that a served studio uses while nobody uses it (nothing trains, no page polls)."
    import psutil
    p, _ = serve(work)
    try:
        time.sleep(2)
        proc = psutil.Process(p.pid)
        c0 = sum(proc.cpu_times()[:2]); time.sleep(seconds)
        return 100 * (sum(proc.cpu_times()[:2]) - c0) / seconds
    finally:
        p.kill()
        p.wait()


def run_studio(trainer: str, steps: int, work: Path, values: list) -> float:
    "Start the run through a served studio's page API, poll `/status` each second, return its steps/s."
    import requests
    from gradio_client import Client
    from course_lib.core import load_checkpoint
    from course_lib.studio import STATUS_EVERY_S
    p, port = serve(work)
    try:
        c = Client(f"http://127.0.0.1:{port}/", verbose=False)
        msg = c.predict(trainer, "bench", 0, "", *values, api_name="/start")   # no sample prompts
        if not msg.startswith("started"): raise RuntimeError(msg)
        poll, page = requests.Session(), uuid.uuid4().hex[:10]   # the page's timer (queue=False), its session
        while not any(w in (s := _status(poll, port, page)) for w in (": done", "error")): time.sleep(STATUS_EVERY_S)
        if "error" in s: raise RuntimeError(s)
        return steps_per_s(load_checkpoint(work/"studio"/"runs"/"bench"/"checkpoint.safetensors")[0]["history"])
    finally:
        p.kill()
        p.wait()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--trainers", default="unet,flux", help="comma-separated: unet (unit 4), flux (unit 7)")
    p.add_argument("--child", choices=["headless", "serve"], help=argparse.SUPPRESS)
    p.add_argument("--trainer", help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child == "headless": return child_headless(a.trainer, a.steps, a.work)
    if a.child == "serve": return child_serve(a.work, a.port)
    idle = idle_cpu(Path(tempfile.mkdtemp(prefix="studio-bench-idle-")))
    out = {}
    for trainer in a.trainers.split(","):
        rates, values = {"headless": [], "studio": []}, form(trainer, a.steps)
        for r in range(a.repeat):
            work = Path(tempfile.mkdtemp(prefix=f"studio-bench-{trainer}-{r}-"))
            res = subprocess.run([sys.executable, str(HERE), "--child", "headless", "--trainer", trainer,
                                  "--steps", str(a.steps), "--work", str(work/"h")],
                                 capture_output=True, text=True, check=True)
            rates["headless"].append(json.loads(res.stdout.strip().splitlines()[-1])["steps_per_s"])
            rates["studio"].append(run_studio(trainer, a.steps, work/"s", values))
        med = {k: statistics.median(v) for k, v in rates.items()}
        out[trainer] = {"headless_steps_per_s": [round(v, 2) for v in rates["headless"]],
                        "studio_steps_per_s": [round(v, 2) for v in rates["studio"]],
                        "ratio": round(med["studio"] / med["headless"], 3)}
    print(f"{'trainer':8s} {'headless steps/s (median)':>26s} {'studio steps/s (median)':>24s} "
          f"{'studio / headless':>18s}  target >= 0.95")
    for t, o in out.items():
        print(f"{t:8s} {statistics.median(o['headless_steps_per_s']):26.2f} "
              f"{statistics.median(o['studio_steps_per_s']):24.2f} {o['ratio']:18.3f}")
    print(f"a served studio, idle: {idle:.1f}% of one core (Gradio's queue, left to itself, polls every 1 ms: "
          f"about 4% here)")
    print(json.dumps({"steps": a.steps, "repeat": a.repeat, "idle_server_cpu_percent": round(idle, 2), **out}))
    return out


if __name__ == "__main__":
    main()
