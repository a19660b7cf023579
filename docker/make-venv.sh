#!/bin/sh
# Create the image's Python environment: a venv at $1 that sees everything the base's
# `python3` sees (torch above all, never re-downloaded) but installs only into itself.
#
# A venv keeps the install clear of the base's own environment, so one recipe works whether
# torch sits in a conda env or venv on PATH (pytorch/pytorch images) or in the system
# interpreter of a PEP 668 base (Debian 12, Ubuntu 24.04), where `pip install` is refused
# outside a venv. Writes $1/base-constraints.txt pinning the base's torch: installing with
# `-c` it makes pip fail rather than fetch another torch. Exits non-zero with one line
# naming what the base lacks.
set -eu

venv="${1:?usage: make-venv.sh VENV_DIR}"

fail() {
    echo "error: $*" >&2
    exit 1
}

command -v python3 >/dev/null || fail "the base image has no python3 on PATH (spot-runner needs python3 >= 3.11 that imports torch)"
python3 - <<'EOF' || exit 1
import sys

if sys.version_info < (3, 11):
    sys.exit(f"error: python3 on PATH ({sys.executable}) is {sys.version.split()[0]}; spot-runner needs >= 3.11")
try:
    import torch
except ImportError as exc:
    sys.exit(f"error: python3 on PATH ({sys.executable}) cannot import torch ({exc}); use a base with torch installed")
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
    sys.exit(f"error: the base's torch is {torch.__version__}; spot-runner needs torch >= 2.6")
EOF

# A venv's system site is the *base interpreter's*: when python3 is itself a venv (torch in
# /opt/venv), --system-site-packages alone would miss it, so its site dirs are added too.
base_sites="$(python3 -c 'import site; print("\n".join(site.getsitepackages()))')"

# Debian and Ubuntu ship ensurepip separately (python3-venv); without it the venv borrows the
# base's pip, which a venv then lets install into the venv.
if python3 -c 'import ensurepip' 2>/dev/null; then
    python3 -m venv --system-site-packages "$venv"
else
    python3 -m venv --system-site-packages --without-pip "$venv"
fi

"$venv/bin/python" - "$base_sites" <<'EOF'
import sys
import sysconfig
from pathlib import Path

missing = [p for p in sys.argv[1].splitlines() if p and Path(p).is_dir() and p not in sys.path]
if missing:
    # addsitedir (not a bare path) so the base's own .pth files are processed as there
    lines = [f"import site; site.addsitedir({p!r})\n" for p in missing]
    Path(sysconfig.get_path("purelib"), "_base_site.pth").write_text("".join(lines))
EOF

"$venv/bin/python" -m pip --version >/dev/null 2>&1 \
    || fail "the base's python3 has neither ensurepip nor pip, so no venv can install packages: add python3-venv (Debian/Ubuntu: apt-get install python3-venv) to the base image"
if [ ! -e "$venv/bin/pip" ]; then
    # A borrowed pip has no script in the venv: `pip` on PATH must still install into it.
    printf '#!/bin/sh\nexec "%s" -m pip "$@"\n' "$venv/bin/python" >"$venv/bin/pip"
    chmod 755 "$venv/bin/pip"
fi

# torchrun from the venv too: the base's `torchrun` script starts every worker with the
# base's interpreter, which cannot import what is installed here (`python -m runner`).
printf '#!/bin/sh\nexec "%s" -m torch.distributed.run "$@"\n' "$venv/bin/python" >"$venv/bin/torchrun"
chmod 755 "$venv/bin/torchrun"

# The venv must resolve torch to the very files python3 on PATH uses.
base_torch="$(python3 -c 'import torch; print(torch.__file__, torch.__version__)')"
venv_torch="$("$venv/bin/python" -c 'import torch; print(torch.__file__, torch.__version__)')"
[ "$base_torch" = "$venv_torch" ] || fail "the venv sees torch at '$venv_torch', the base at '$base_torch'"
echo "torch==${base_torch##* }" > "$venv/base-constraints.txt"
echo "venv $venv on $(command -v python3), torch ${base_torch}"
