"""Screenshots of a built course website, one lesson per unit, as a reader's browser shows it.

    course site --profile full --out /tmp/site-full        # build it first
    python tools/site_screenshots.py /tmp/site-full         # -> test-artifacts/site-full/*.png
    python tools/site_screenshots.py /tmp/site-full --readme   # also units/<unit>/site-page.png

For each lesson unit: the first lesson whose page shows a figure. Two pictures: the top of the page (title, the
Colab badge, the line that says which profile, date and machine produced it) and the first figure with the cell
above it. Headless Chromium through Playwright (as tests/test_site.py; Chromium from COURSE_LIB_CHROMIUM or PATH).
Prints a table: unit, lesson, execution line, figures shown on the page, files written."""
import argparse, functools, http.server, os, shutil, sys, threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    for c in [os.environ.get("COURSE_LIB_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"]:
        if c and shutil.which(c):
            return shutil.which(c)
    sys.exit("no Chromium found: apt-get install chromium, or set COURSE_LIB_CHROMIUM")


def serve(site: Path):
    quiet = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("site", type=Path, help="folder of a site built by `course site`")
    a.add_argument("--out", type=Path, default=ROOT / "test-artifacts" / "site-full")
    a.add_argument("--readme", action="store_true", help="also write units/<unit>/site-page.png (the top)")
    args = a.parse_args(argv)
    if not (args.site / "index.html").is_file():
        sys.exit(f"{args.site} has no index.html: build the site first (course site --out {args.site})")
    from playwright.sync_api import sync_playwright
    from course_lib.course import load_units
    args.out.mkdir(parents=True, exist_ok=True)
    server, base = serve(args.site)
    rows = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        for u in load_units(ROOT):
            if u.number in (0, 99):
                continue
            for nb in u.notebooks:
                rel = f"units/{u.name}/{nb.stem}.html"
                if not (args.site / rel).is_file():
                    continue
                page.goto(base + rel, wait_until="load")
                page.wait_for_load_state("networkidle")
                figs = page.locator(".cell_output img")
                shown = page.evaluate("() => [...document.querySelectorAll('.cell_output img')]"
                                      ".filter(i => i.complete && i.naturalWidth > 0).length")
                if shown == 0:
                    continue
                note = page.locator("p:has(img[src*='colab-badge'])").first.inner_text().strip()
                top = args.out / f"{u.name}-{nb.stem}-top.png"
                page.screenshot(path=str(top))
                fig = args.out / f"{u.name}-{nb.stem}-figure.png"
                figs.first.scroll_into_view_if_needed()
                page.wait_for_timeout(200)
                page.screenshot(path=str(fig))
                files = [top, fig]
                if args.readme:
                    dst = u.path / "site-page.png"
                    shutil.copyfile(top, dst)
                    files.append(dst)
                rows.append((u.name, nb.stem, note, shown, files))
                break
        browser.close()
    server.shutdown()
    print("| unit | lesson | the page's execution line | figures shown | files |")
    print("|---|---|---|---|---|")
    for name, stem, note, shown, files in rows:
        sizes = ", ".join(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f} ({f.stat().st_size // 1024} KB)"
                          for f in files)
        print(f"| {name} | {stem} | {note} | {shown} | {sizes} |")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
