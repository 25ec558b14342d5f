#!/usr/bin/env bash
# Proves with pip's own resolver (network: PyPI) that installing course_lib's runtime, as a lesson's
# install cell does on Colab, leaves Colab's pinned packages (colab-constraints.txt) as they are:
# builds the wheel, resolves it for Colab's Python with those pins as constraints
# (`pip install --dry-run --report`), and fails when the resolver finds no solution or would install
# another version of a pinned package.
# Usage: tools/check_colab_constraints.sh [PYTHON_VERSION] (default 3.13, as Colab; $PYTHON: pip)
# Not in the test suite (it needs the network): run it when the requirements or the pins change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PYVER="${1:-3.13}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip wheel . --no-deps --no-build-isolation -q -w "$tmp/dist"
wheel="$(ls "$tmp"/dist/course_lib-*.whl)"
# plain PyPI: no machine-wide pip config (local wheel folders, caps); Colab's Python and platform
# (Ubuntu 22.04, glibc 2.35, so every manylinux tag up to 2_35: pip does not expand one given tag)
platforms=(--platform manylinux2014_x86_64 --platform linux_x86_64)
for v in $(seq 17 35); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
if ! env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    "$PY" -m pip install --dry-run --ignore-installed --report "$tmp/report.json" \
    --target "$tmp/site" --only-binary=:all: --python-version "$PYVER" \
    "${platforms[@]}" \
    --implementation cp -c colab-constraints.txt "$wheel" >"$tmp/pip.log" 2>&1; then
  echo "FAIL: no install of course_lib keeps colab-constraints.txt (Python $PYVER):" >&2
  grep -v "^ *$" "$tmp/pip.log" | tail -40 >&2
  exit 1
fi
"$PY" - "$tmp/report.json" colab-constraints.txt "$PYVER" <<'PYEOF'
import json, re, sys
report, constraints, pyver = sys.argv[1:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
got = {norm(i["metadata"]["name"]): i["metadata"]["version"]
       for i in json.load(open(report))["install"]}
pins = {}
for line in open(constraints):
    line = line.split("#")[0].strip()
    if line:
        name, _, ver = line.partition("==")
        pins[norm(name)] = ver.strip()
bad = [f"{n}: Colab has {v}, the install would bring {got[n]}" for n, v in pins.items()
       if n in got and got[n].split("+")[0] != v]
print(f"resolved {len(got)} packages for Python {pyver}; Colab's pinned packages in the install:")
changed = {b.split(":")[0] for b in bad}
for n, v in pins.items():
    state = "not needed" if n not in got else "CHANGED" if n in changed else "kept"
    print(f"  {n}=={v}: {state}" + (f" ({got[n]})" if n in got else ""))
if bad:
    sys.exit("FAIL: " + "; ".join(bad))
print("OK: the runtime install leaves Colab's pinned packages unchanged")
PYEOF
