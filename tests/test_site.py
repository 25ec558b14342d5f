"""The course website: `course site` builds it offline, and headless Chromium checks it as a reader sees it.

The build here uses the quick profile, unit 0 (executed) and the library's own unit (shown unexecuted) only, to stay fast; set COURSE_LIB_SITE=DIR to run the same
checks against a site built beforehand (for example `course site --profile full --out DIR`, all units).
Browser tests need Chromium (Debian's `chromium`, or COURSE_LIB_CHROMIUM=path) and the `playwright` package (a dev
requirement, imported plainly); without Chromium they skip and say why. Screenshots go to test-artifacts/."""
import html.parser, http.server, importlib, json, os, posixpath, re, shutil, subprocess, sys, tempfile, threading
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit, unquote

import pytest
from filelock import FileLock

from course_lib.course import load_units, find_unit
from course_lib.course import (
    find_executed, library_modules, rewrite_links, executed_matches, lesson_notebook, site_settings)
from course_lib.course import with_current_text

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
# the profile of a site built beforehand (COURSE_LIB_SITE); the site built here is the quick one
PROFILE = os.environ.get("COURSE_LIB_SITE_PROFILE", "quick") if os.environ.get("COURSE_LIB_SITE") else "quick"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-quic"]


# ---------------------------------------------------------------- building (shared by the xdist workers)

@pytest.fixture(scope="session")
def site(tmp_path_factory):
    """(site folder, executed-notebooks folder, units in the site). Built once per test run, whichever worker
    gets here first (a file lock in the run's shared temporary folder)."""
    importlib.import_module("myst_nb")   # a dev requirement: missing is an error, not a skip
    units = load_units(ROOT)
    if os.environ.get("COURSE_LIB_SITE"):
        d = Path(os.environ["COURSE_LIB_SITE"])
        return (d, Path(os.environ.get("COURSE_LIB_SITE_EXECUTED", ROOT / "runs" / f"site-{PROFILE}")),
                [u for u in units if (d / "units" / u.name / "index.html").is_file()])
    # one build per test session: under xdist the workers' base folders share a parent; without it that parent
    # is shared by every session of the user, so the session's own base folder is used
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "course-site"
    shared.mkdir(exist_ok=True)
    out, executed, log = shared / "site", shared / "executed", shared / "build.log"
    with FileLock(str(shared / "lock")):
        if not (shared / "done").is_file():
            # unit 0 executed (its lesson with figures and a measured time); the library's notebooks, which
            # tests/test_notebooks.py runs, shown without outputs (--no-execute) to keep the build short
            env = dict(os.environ, COURSE_LIB_ROOT=str(ROOT))
            run = [sys.executable, "-c", "import sys; from course_lib.cli.course import main; sys.exit(main())",
                   "run", "start", "--profile", "quick", "--out", str(executed)]
            r = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
            if r.returncode == 0:
                cmd = [sys.executable, "-c", "import sys; from course_lib.cli.site import site_main; sys.exit(site_main(sys.argv[1:]))",
                       "--profile", "quick", "--units", "start", "library", "--no-execute", "--out", str(out),
                       "--executed", str(executed)]
                r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
            log.write_text(f"exit {r.returncode}\n{r.stdout}\n{r.stderr}")
            (shared / "done").write_text(str(r.returncode))
    rc, text = (shared / "done").read_text(), log.read_text()
    assert rc == "0", f"`course site --profile quick --units start library --no-execute` failed:\n{text[-6000:]}"
    return out, executed, [find_unit("start", units), find_unit("library", units)]


def _pages(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*.html") if "_static" not in p.parts and "_sources" not in p.parts)


def _lessons(site_dir: Path, units):
    return [(u, nb, site_dir / "units" / u.name / f"{nb.stem}.html") for u in units for nb in u.notebooks]


class _Refs(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(); self.links, self.images, self.ids = [], [], set()
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"): self.ids.add(a["id"])
        if tag == "a" and a.get("href"): self.links.append(a["href"])
        if tag == "img" and a.get("src"): self.images.append(a["src"])
        if tag in ("link", "script") and (a.get("href") or a.get("src")): self.images.append(a.get("href") or a.get("src"))


def _parse(p: Path) -> _Refs:
    r = _Refs(); r.feed(p.read_text(errors="replace")); return r


def _local(page: Path, ref: str, site_dir: Path):
    "(target file, fragment) of a local reference, or None for an external one."
    u = urlsplit(ref)
    if u.scheme or u.netloc or ref.startswith("data:") or ref.startswith("javascript:"): return None
    path = unquote(u.path)
    target = page if not path else (site_dir / path.lstrip("/") if path.startswith("/") else page.parent / path)
    if target.is_dir(): target = target / "index.html"
    return target.resolve(), u.fragment


# ---------------------------------------------------------------- what the build wrote (no browser)

def test_site_has_every_page(site):
    d, _, units = site
    for p in ["index.html", "contributing.html", "api/index.html", *[f"api/{m}.html" for m in library_modules(ROOT)]]:
        assert (d / p).is_file(), f"the site has no {p}"
    for u in units:
        assert (d / "units" / u.name / "index.html").is_file(), f"no landing page for unit {u.name}"
    for u, nb, page in _lessons(d, units):
        assert page.is_file(), f"no page for lesson {nb.name}"


def test_home_page_lists_units_with_times(site):
    d, _, units = site
    text = (d / "index.html").read_text()
    assert "A Jupyter-first course" in text
    for u in load_units(ROOT):
        row = re.search(rf"<td><p>{u.number}</p></td>\s*<td><p>.*?{re.escape(u.title)}", text, re.S)
        if u.is_library: assert not row, "the library's unit is a row of the lessons' table"
        else: assert row, f"unit {u.number} missing from the table"
    assert re.search(rf"{PROFILE} \d+(\.\d)? (s|min)", text), "no measured time in the unit table"
    assert 'href="units/00_start/index.html"' in text and 'href="units/99_library/index.html"' in text


def test_library_section_after_the_lessons(site):
    "The library's notebooks were unit 0's, the learner's first lesson; they are a section after the lessons."
    d, _, _ = site
    text = (d / "index.html").read_text()
    units, library = text.find(">Units<"), text.find(">Library<")
    assert 0 <= units < library and text.find(">Reference<") > library, "no Library section after the Units"
    assert (d / "units" / "99_library" / "00_core.html").is_file()


def test_site_build_prints_no_warning(site):
    "The build printed docutils errors and warnings for docstrings (`as_uint8_images`, `GaussianMixture`, ...)."
    d, _, _ = site
    log = d.parent / "build.log"
    if not log.is_file(): pytest.skip("a site built beforehand (COURSE_LIB_SITE): its build log is not here")
    warnings = [l for l in log.read_text().splitlines() if re.search(r"\b(WARNING|ERROR|SEVERE):", l)]
    assert not warnings, "the site build printed warnings:\n" + "\n".join(warnings[:20])


def test_every_lesson_page_says_which_profile_produced_it(site):
    "Each executed lesson's page names its run's profile (and date and machine); a page without a run says so."
    from course_lib.course import PROFILE_NOTE
    d, executed_dir, units = site
    bad = []
    for u, nb, page in _lessons(d, units):
        text = html.unescape(re.sub(r"<[^>]+>", "", page.read_text())).replace("\u2019", "'")   # smartquotes
        ran = find_executed(u, nb, PROFILE, [executed_dir])
        want = f"Executed with {PROFILE_NOTE[PROFILE]} on " if ran else "Not executed"
        if want not in text: bad.append(f"{u.name}/{nb.name}: no '{want}'")
    assert not bad, "\n".join(bad[:20])


def test_lessons_have_colab_links(site):
    d, _, units = site
    cfg = site_settings(ROOT)
    for u, nb, page in _lessons(d, units):
        url = f"https://colab.research.google.com/github/{cfg['user']}/{cfg['repo']}/blob/{cfg['branch']}/nbs/{nb.name}"
        assert f'href="{url}"' in page.read_text(), f"{page.name} has no Open in Colab link to {url}"


def test_api_reference_from_docstrings(site):
    d, _, _ = site
    text = (d / "api" / "core.html").read_text()
    assert "seed_everything" in text and "atomically" in text, "autodoc did not render course_lib.core.basics's docstrings"
    assert "00_core.html" in text, "the API page does not link to its notebook"


def test_internal_links_and_images_resolve(site):
    d, _, _ = site
    bad, cache = [], {}
    for page in _pages(d):
        refs = _parse(page)
        for kind, items in (("link", refs.links), ("image/asset", refs.images)):
            for ref in items:
                loc = _local(page, ref, d)
                if loc is None: continue
                target, frag = loc
                if not target.is_file():
                    bad.append(f"{page.relative_to(d)}: {kind} {ref} -> missing file"); continue
                if frag and target.suffix == ".html":
                    if target not in cache:      # (setdefault would parse the target at every link)
                        cache[target] = _parse(target).ids if target != page.resolve() else refs.ids
                    ids = cache[target]
                    if frag not in ids: bad.append(f"{page.relative_to(d)}: {kind} {ref} -> no #{frag}")
    assert not bad, "broken references:\n" + "\n".join(bad[:40])


def test_nothing_is_loaded_from_the_web(site):
    d, _, _ = site
    ext = []
    for page in _pages(d):
        for ref in _parse(page).images:
            if urlsplit(ref).scheme in ("http", "https") or ref.startswith("//"): ext.append(f"{page.name}: {ref}")
    assert not ext, "pages load images/scripts/styles from the web (the site must work offline):\n" + "\n".join(ext[:20])


# ---------------------------------------------------------------- the generator's pieces

def test_rewrite_links(tmp_path):
    (tmp_path / "units" / "01_ddpm").mkdir(parents=True)
    (tmp_path / "units" / "01_ddpm" / "fig.png").write_bytes(b"\x89PNG")
    cfg = {"git_url": "https://github.com/u/r", "branch": "main"}
    pages = {"nbs/10_a.ipynb": "units/01_ddpm/10_a.ipynb", "units/00_start/README.md": "units/00_start/index.md"}
    copies = {}
    md = ("[a](../../nbs/10_a.ipynb#x) [b](../00_start/README.md) [c](../../benchmarks/b.py) ![f](fig.png) "
          "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/u/r/blob/main/nbs/10_a.ipynb) "
          '![ci](https://img.shields.io/x.svg) <img src="https://colab.research.google.com/assets/colab-badge.svg"> [top](#goals)')
    out = rewrite_links(md, "units/01_ddpm/README.md", "units/01_ddpm/index.md", pages, cfg, tmp_path, copies)
    assert "[a](10_a.ipynb#x)" in out and "[b](../00_start/index.md)" in out and "[top](#goals)" in out
    assert "[c](https://github.com/u/r/blob/main/benchmarks/b.py)" in out
    assert "![f](fig.png)" in out and copies == {"units/01_ddpm/fig.png": "units/01_ddpm/fig.png"}
    assert "[![Open In Colab](../../_static/colab-badge.svg)](https://colab.research.google.com/github/u/r/blob/main/nbs/10_a.ipynb)" in out
    assert "shields.io" not in out and "![ci]" not in out and 'src="../../_static/colab-badge.svg"' in out


def test_executed_copy_must_match_the_notebook():
    src = {"cells": [{"cell_type": "markdown", "source": "# t", "metadata": {}},
                     {"cell_type": "code", "source": "#| gpu\nx = 1", "metadata": {}, "outputs": []},
                     {"cell_type": "code", "source": "y = 2", "metadata": {}, "outputs": []}], "metadata": {}}
    injected = {"cell_type": "code", "source": "y = 3", "metadata": {"tags": ["injected-parameters"]}, "outputs": []}
    ok = {"cells": [src["cells"][0], injected, src["cells"][2]], "metadata": {"papermill": {"exception": False}}}
    assert executed_matches(ok, src)                      # the gpu cell was dropped, parameters injected
    assert not executed_matches({**ok, "metadata": {"papermill": {"exception": True}}}, src)  # it failed
    edited = json.loads(json.dumps(src)); edited["cells"][2]["source"] = "y = 4"
    assert not executed_matches(ok, edited)               # the notebook changed since it ran
    assert not executed_matches({"cells": ok["cells"][:1], "metadata": {}}, src)  # it stopped early


def test_an_edit_of_the_text_keeps_the_outputs_and_the_page_shows_the_new_text():
    "Outputs depend on the code cells only: a corrected sentence must not cost a re-run of a 60-minute profile."
    src = {"cells": [{"cell_type": "markdown", "source": "# t\nold text", "metadata": {}},
                     {"cell_type": "code", "source": "steps = 1", "metadata": {"tags": ["parameters"]}, "outputs": []},
                     {"cell_type": "code", "source": "#| gpu\nx = 1", "metadata": {}, "outputs": []},
                     {"cell_type": "code", "source": "print(steps)", "metadata": {}, "outputs": []}], "metadata": {}}
    injected = {"cell_type": "code", "source": "steps = 3", "metadata": {"tags": ["injected-parameters"]},
                "outputs": []}
    out = {"output_type": "stream", "name": "stdout", "text": "3\n"}
    ran = {**src["cells"][3], "outputs": [out]}
    ex = {"cells": [src["cells"][0], src["cells"][1], injected, ran], "metadata": {"papermill": {"exception": False}}}
    now = json.loads(json.dumps(src))
    now["cells"][0]["source"] = "# t\nnew text"
    now["cells"].insert(3, {"cell_type": "markdown", "source": "an added paragraph", "metadata": {}})
    assert executed_matches(ex, now)
    page = with_current_text(ex, now)
    # the page shows the values it ran with once: papermill's injected cell merged into the parameters cell
    assert [c["source"] for c in page["cells"]] == ["# t\nnew text", "steps = 3  # notebook default: 1",
                                                   "#| gpu\nx = 1", "an added paragraph", "print(steps)"]
    assert page["cells"][-1]["outputs"] == [out] and page["cells"][2]["outputs"] == []
    assert page["metadata"] == ex["metadata"]
    code_edit = json.loads(json.dumps(now))
    code_edit["cells"][-1]["source"] = "print(steps + 1)"
    assert not executed_matches(ex, code_edit)            # a code edit still needs a run


def test_lesson_notebook_hides_nbdev_directives_and_widgets():
    cfg = {"user": "u", "repo": "r", "branch": "main"}
    nb = {"metadata": {"widgets": {"state": {}}}, "cells": [
        {"cell_type": "markdown", "source": "# Title", "metadata": {}},
        {"cell_type": "code", "source": "#| default_exp core", "metadata": {}, "outputs": []},
        {"cell_type": "code", "source": "#| hide\nsecret = 1", "metadata": {}, "outputs": []},
        {"cell_type": "code", "source": "#| export\ndef f(): pass", "metadata": {}, "outputs": [
            {"output_type": "stream", "name": "stderr", "text": "warning"},
            {"output_type": "display_data", "metadata": {}, "data": {
                "application/vnd.jupyter.widget-view+json": {"model_id": "1"}, "text/plain": " 40%|####  | 4/10"}}]}]}
    page = lesson_notebook(nb, "00_core.ipynb", cfg)
    srcs = [c["source"] for c in page["cells"]]
    assert srcs[0] == "# Title" and "https://colab.research.google.com/github/u/r/blob/main/nbs/00_core.ipynb" in srcs[1]
    assert srcs[2:] == ["def f(): pass"] and page["cells"][2]["outputs"] == [] and "widgets" not in page["metadata"]


def test_site_command_rejects_bad_arguments(tmp_path, capsys):
    from course_lib.cli.site import site_main
    assert site_main(["--profile", "slow"]) == 2
    assert site_main(["--units", "no-such-unit"]) == 2
    assert "unknown unit 'no-such-unit'" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("mine")
    assert site_main(["--units", "start", "--out", str(tmp_path)]) == 2      # never wipes a folder it did not build
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert "not a site built by `course site`" in capsys.readouterr().err


def _documented(module) -> list[tuple[str, str]]:
    """`(name, docstring)` of what the API page of `module` shows: `automodule :members:` takes the module's
    docstring, the names of `__all__` defined in that module (re-exports are left to their own module), and
    the public methods and properties of its classes (those that `@patch` added too)."""
    import inspect
    out = [(module.__name__, inspect.getdoc(module) or "")]
    for name in getattr(module, "__all__", []):
        obj = getattr(module, name, None)
        if getattr(obj, "__module__", None) != module.__name__: continue
        out.append((f"{module.__name__}.{name}", inspect.getdoc(obj) or ""))
        if not inspect.isclass(obj): continue
        for attr, member in vars(obj).items():
            if attr.startswith("_"): continue
            doc = inspect.getdoc(member.fget if isinstance(member, property) else member)
            if callable(member) or isinstance(member, (property, classmethod, staticmethod)):
                out.append((f"{module.__name__}.{name}.{attr}", doc or ""))
    return out


SPHINX_ROLES = ("class", "func", "meth", "attr", "mod", "obj", "exc", "data", "const", "ref", "doc", "term", "any",
                "py:class", "py:func", "py:meth", "py:attr", "py:mod", "py:obj", "py:exc", "py:data")


def docstring_problems(doc: str, where: str) -> list[str]:
    """The docutils errors and warnings of docstring `doc`, parsed as autodoc parses it for the site: its
    lines prepared by Sphinx (`prepare_docstring`), reStructuredText with `default_role = "literal"`."""
    import io
    from docutils import nodes
    from docutils.core import publish_doctree
    from docutils.parsers.rst import roles
    from sphinx.util.docstrings import prepare_docstring
    for role in SPHINX_ROLES:                  # Sphinx's cross-reference roles (inherited torch docstrings use them)
        roles.register_generic_role(role, nodes.literal)
    stream = io.StringIO()
    text = ".. default-role:: literal\n\n" + "\n".join(prepare_docstring(doc))
    publish_doctree(text, source_path=where, settings_overrides={
        "report_level": 2, "halt_level": 5, "warning_stream": stream, "file_insertion_enabled": False,
        "raw_enabled": False})
    found = [l for l in stream.getvalue().splitlines() if re.search(r"\((WARNING|ERROR|SEVERE)/", l)]
    # line numbers as Sphinx prints them: of the docstring, without the two lines put in front
    return [re.sub(r"^(.*?):(\d+):", lambda m: f"{m.group(1)}:{int(m.group(2)) - 2}:", l) for l in found]


def test_docstring_problems_are_found():
    "The check sees what the site build printed for `as_uint8_images` before its docstring was fixed."
    bad = ("Images as uint8.\n\n    `source`:\n    - a folder of images;\n    - a tensor `(N, C, H, W)`: uint8, or float\n"
           "      in [-1, 1];\n    - a callable.\n    `num_samples`: keep the first ones.")
    found = docstring_problems(bad, "demo")
    assert any("Unexpected indentation" in l for l in found), found
    assert any("Bullet list ends without a blank line" in l for l in found), found
    assert docstring_problems("Fine.\n\n    - a\n    - b\n\n    Returns `x`.", "ok") == []


@pytest.mark.parametrize("module", sorted(library_modules(ROOT)))
def test_api_docstrings_render_without_warnings(module):
    """Every docstring on the API reference renders without a docutils error or warning (the site build
    printed them, e.g. for `as_uint8_images` and `GaussianMixture`); a list needs a blank line after it."""
    mod = importlib.import_module(f"course_lib.{module}")
    bad = [p for name, doc in _documented(mod) for p in docstring_problems(doc, name)]
    assert not bad, (f"course_lib.{module}: docstrings that the site renders with docutils warnings (write "
                     "lists and indented blocks with a blank line before and after):\n" + "\n".join(bad[:20]))


# ---------------------------------------------------------------- in a real browser

def _in_ci() -> bool:
    "True under CI (`CI=true`, as GitHub Actions and .ci/run set it): there a missing browser is a failure."
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _no_browser(why: str):
    "Skip the browser tests locally; fail them in CI, where Chromium is installed by .ci/run and the workflow."
    if _in_ci():
        pytest.fail(f"browser tests cannot run in CI (CI=true): {why}", pytrace=False)
    pytest.skip(f"browser tests skipped: {why}")


def _chromium() -> str | None:
    for c in [os.environ.get("COURSE_LIB_CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]:
        if c and shutil.which(c): return shutil.which(c)
    return None


@pytest.fixture(scope="module")
def browser(site, tmp_path_factory):
    """(page factory, base URL, site folder): headless Chromium via Playwright, the site on a localhost server."""
    exe = _chromium()
    if exe is None:
        _no_browser("no Chromium found (apt-get install chromium, or set COURSE_LIB_CHROMIUM)")
    from playwright.sync_api import sync_playwright   # a dev requirement: missing is an error
    d = site[0]
    handler = partial(type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None}), directory=str(d))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    pw = sync_playwright().start()
    try:
        ctx = pw.chromium.launch_persistent_context(str(tmp_path_factory.mktemp("chromium-profile")), executable_path=exe,
                                                    headless=True, args=CHROMIUM_FLAGS, viewport={"width": 1280, "height": 900})
    except Exception as e:
        pw.stop(); server.shutdown()
        _no_browser(f"Chromium at {exe} does not start ({str(e).splitlines()[0]})")
    try: yield ctx, base, d
    finally:
        ctx.close(); pw.stop(); server.shutdown(); server.server_close()


def _listen(page, problems: list):
    "Collect into `problems` the page's console errors, uncaught exceptions, failed or 4xx/5xx requests."
    page.on("console", lambda m: problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)


def _visit(ctx, url):
    "Open `url`; returns (page, problems): console errors, uncaught exceptions, failed or 4xx/5xx requests."
    page, problems = ctx.new_page(), []
    _listen(page, problems)
    page.goto(url, wait_until="load")
    page.wait_for_load_state("networkidle")
    return page, problems


def _visit_all(ctx, urls, js=None, batch=8):
    """{url: (problems, result of the script `js` on the loaded page or None)} for every url, as `_visit` opens
    one. Pages open `batch` at a time, so their networkidle waits (half a second each after the load) overlap."""
    out = {}
    for i in range(0, len(urls), batch):
        opened = []
        for u in urls[i:i + batch]:
            page, problems = ctx.new_page(), []
            _listen(page, problems)
            page.goto(u, wait_until="load")
            opened.append((u, page, problems))
        for u, page, problems in opened:
            page.wait_for_load_state("networkidle")
            out[u] = (problems, page.evaluate(js) if js else None)
            page.close()
    return out


FIGURES_JS = """() => {
  const out = document.querySelectorAll('.cell_output, .output');
  const imgs = [...document.querySelectorAll('.cell_output img')];
  return {shown: imgs.filter(i => i.complete && i.naturalWidth > 0).length,
          broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => (i.src || '').slice(0, 80)),
          svgs: document.querySelectorAll('.cell_output svg').length,
          animations: document.querySelectorAll('.cell_output .animation img[id^="_anim_img"]').length};
}"""


def _expected_figures(executed: Path | None) -> int:
    "Figure outputs (images, SVG, animations) in an executed notebook."
    if executed is None: return 0
    n = 0
    for c in json.loads(executed.read_text())["cells"]:
        for o in c.get("outputs", []):
            data = o.get("data", {})
            html_ = "".join(data.get("text/html", ""))
            if "image/png" in data or "image/jpeg" in data or "image/svg+xml" in data or "_anim_img" in html_: n += 1
    return n


def test_every_page_loads_without_console_errors(browser):
    ctx, base, d = browser
    report = []
    seen = _visit_all(ctx, [base + p.relative_to(d).as_posix() for p in _pages(d)])
    for u, (problems, _) in seen.items():
        report += [f"{u[len(base):]}: {x}" for x in problems]
    assert len(seen) == len(_pages(d)) and not report, "pages with errors in the browser:\n" + "\n".join(report[:40])


def test_every_lesson_shows_its_figures(browser, site):
    ctx, base, d = browser
    _, executed_dir, units = site
    missing = []
    lessons = _lessons(d, units)
    seen = _visit_all(ctx, [base + h.relative_to(d).as_posix() for _, _, h in lessons], js=FIGURES_JS)
    for u, nb, html_page in lessons:
        f = seen[base + html_page.relative_to(d).as_posix()][1]
        shown = f["shown"] + f["svgs"]
        expected = _expected_figures(find_executed(u, nb, PROFILE, [executed_dir]))
        if f["broken"]: missing.append(f"{nb.name}: images that do not render: {f['broken']}")
        # the library's notebooks (core, data, cli, site, ...) may have no figure; every lesson must show one
        if shown < max(expected, 0 if u.is_library and expected == 0 else 1):
            missing.append(f"{nb.name}: {shown} figure(s) rendered, the executed notebook has {expected}")
    assert not missing, "\n".join(missing)
    assert any(_expected_figures(find_executed(u, nb, PROFILE, [executed_dir])) for u, nb, _ in _lessons(d, units)), \
        "no lesson in the site has a figure"


def test_internal_links_resolve_in_the_browser(browser):
    ctx, base, d = browser
    urls = set()
    for p in [d / "index.html", *sorted((d / "units").rglob("index.html")), d / "api" / "index.html"]:
        page, _ = _visit(ctx, base + p.relative_to(d).as_posix())
        urls.update(u.split("#")[0] for u in page.eval_on_selector_all("a[href]", "as => as.map(a => a.href)")
                    if u.startswith(base))
        page.close()
    bad = []
    for u in sorted(urls):
        r = ctx.request.get(u)
        if r.status != 200: bad.append(f"{u}: HTTP {r.status}")
    assert urls and not bad, "\n".join(bad)


def test_screenshots(browser, site):
    ctx, base, d = browser
    _, executed_dir, units = site
    ARTIFACTS.mkdir(exist_ok=True)
    lesson = next((h for u, nb, h in _lessons(d, units) if _expected_figures(find_executed(u, nb, PROFILE, [executed_dir]))), None)
    assert lesson is not None, "no lesson with a figure to take a screenshot of"
    for name, p in [("site-home.png", d / "index.html"), ("site-lesson.png", lesson)]:
        page, _ = _visit(ctx, base + p.relative_to(d).as_posix())
        page.wait_for_timeout(300)
        page.screenshot(path=str(ARTIFACTS / name), full_page=True)
        page.close()
        assert (ARTIFACTS / name).stat().st_size > 10_000, f"{name} looks empty"


def test_missing_browser_fails_in_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="browser tests cannot run in CI"): _no_browser("no Chromium")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="browser tests skipped: no Chromium"): _no_browser("no Chromium")


def test_lesson_pages_show_exercises_not_solutions(site):
    "Each built lesson page shows its exercises and the checker's verdict on the stub, never a reference solution."
    import course_lib.exercises as ex
    d, _, units = site
    lessons = [(u, nb, p) for u, nb, p in _lessons(d, units)
               if "### Exercise 1 —" in nb.read_text(encoding="utf-8")]
    assert lessons, "no lesson page with exercises in the site"
    refs = [n for n in dir(ex) if n.startswith("_ref_")]
    for u, nb, page in lessons:
        text = page.read_text(encoding="utf-8")
        assert re.search(r"Exercise 1\s*(—|&#8212;|&mdash;)", text), f"{page.name}: no 'Exercise 1 —' heading"
        assert "not done yet" in text, f"{page.name}: the checker's output on the stub is not on the page"
        shown = [r for r in refs if r in text or f"def {r}" in text]
        assert not shown, f"{page.name} shows reference solutions {shown[:3]}"
