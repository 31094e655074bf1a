#!/usr/bin/env bash
# On a machine that reaches a package index: the wheels an offline GPU host needs besides its
# own Python 3.12 stack (docs/device-check.md#an-offline-gpu-host). The host brings JAX, optax,
# numpy, pyyaml, jinja2, safetensors, tokenizers, ... but not jsonschema (recipe validation):
# this downloads jsonschema and its dependencies at uv.lock's versions, checked against
# uv.lock's sha256 hashes, as CPython 3.12 manylinux x86_64 wheels, into DIR (default
# gpu-wheels/), and refuses a folder over the size that may travel with the source tree.
#
#   benchmarks/gpu_offline_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-gpu-wheels}"
limit_bytes=$((16 << 20)) # of the 64 MiB that travel; the source tree takes the rest
mkdir -p "$dest"
rm -f "$dest"/*.whl

# jsonschema and what it needs on 3.12 (typing-extensions: referencing's, below 3.13), with
# every wheel hash uv.lock records for them: pip downloads only a file the lock vouches for
python3 - "$dest/requirements.txt" <<'EOF'
import sys
import tomllib

wanted = ["jsonschema", "attrs", "jsonschema-specifications", "referencing", "rpds-py",
          "typing-extensions"]
with open("uv.lock", "rb") as handle:
    packages = {p["name"]: p for p in tomllib.load(handle)["package"]}
lines = []
for name in wanted:
    package = packages[name]
    hashes = [w["hash"] for w in package.get("wheels", [])]
    lines.append(" \\\n    ".join([f"{name}=={package['version']}",
                                    *(f"--hash={h}" for h in hashes)]))
with open(sys.argv[1], "w") as handle:
    handle.write("\n".join(lines) + "\n")
EOF

python3 -m pip download --quiet --disable-pip-version-check --no-deps --require-hashes \
    --only-binary=:all: --implementation cp --python-version 3.12 \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 \
    --dest "$dest" -r "$dest/requirements.txt"

count=$(find "$dest" -name '*.whl' | wc -l)
size=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
if [ "$count" -ne 6 ]; then
    echo "gpu_offline_wheels: expected 6 wheels in $dest, found $count" >&2
    exit 1
fi
if [ "$size" -gt "$limit_bytes" ]; then
    echo "gpu_offline_wheels: $dest holds $size bytes, more than $limit_bytes" >&2
    exit 1
fi
echo "gpu_offline_wheels: $count wheels, $size bytes in $dest:" >&2
ls -1 "$dest"/*.whl >&2
