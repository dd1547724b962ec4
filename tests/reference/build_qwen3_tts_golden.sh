#!/usr/bin/env bash
# Golden files of the Qwen3-TTS reference (qwen-tts 0.1.1, which pins transformers 4.57.3) for the
# tests that compare omnistream's Qwen3-TTS against it (they skip while these are absent).
#
# Runs with the project's venv active. No second venv and no second torch: the packages that
# differ from the main venv (transformers 4.57.3 and the versions it needs, qwen-tts, what
# qwen_tts imports) go into a --target folder put first on PYTHONPATH, so they shadow the main
# venv's copies and everything else (torch, numpy, safetensors, einops) is the main venv's.
# torchaudio and onnxruntime are stubs (tests/reference/stubs: imported by qwen_tts's 25 Hz
# tokenizer only, never run on the 12 Hz path).
#
# `build_qwen3_tts_golden.sh install` only installs the packages (.ci/run does that in the
# background while it installs the clients), then exits.
#
# Every tests/reference/qwen3_tts*_golden.py runs as `python SCRIPT OUT` into
# .cache/qwen3tts-golden/<script stem>/. Idempotent: the install is redone only when the package
# list changes, a script's output only when the script or the package list changes; outputs are
# written beside and moved into place, so a failed run leaves no partial folder behind.
set -euo pipefail
cd "$(dirname "$0")/../.."

PACKAGES="qwen-tts==0.1.1 transformers==4.57.3 accelerate==1.12.0 tokenizers==0.22.2 huggingface_hub==0.36.2
  requests==2.34.2 charset-normalizer==3.5.3 idna==3.20 urllib3==2.8.0 certifi==2026.10.19.post1
  librosa==0.11.0 lazy_loader==0.6 scipy==1.17.1 numba==0.68.1 llvmlite==0.50.0 joblib==1.6.0
  cloudpickle==3.1.3 decorator==5.3.1 msgpack==1.2.4 pooch==1.9.0 platformdirs==4.14.9
  soundfile==0.14.0 cffi==2.1.1 pycparser==3.12 sox==1.5.0"
TARGET=.cache/qwen3tts-ref
OUT=.cache/qwen3tts-golden
STUBS=tests/reference/stubs
stamp=$(echo "$PACKAGES" | sha256sum | cut -c1-16)

if [ "$(cat "$TARGET/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$TARGET.new"
    # --no-deps: exactly the list above (pip would otherwise pull a second torch and upgrade
    # what the main venv already has)
    # shellcheck disable=SC2086
    python -m pip install -q --disable-pip-version-check --no-deps --target "$TARGET.new" $PACKAGES
    echo "$stamp" > "$TARGET.new/.stamp"
    rm -rf "$TARGET" && mv "$TARGET.new" "$TARGET"
fi
[ "${1:-}" = install ] && exit 0

export PYTHONPATH="$TARGET:$STUBS"
# the shadowing must hold, or the golden files would come from the main venv's transformers
check_shadowing() {
    local log
    log=$(python - 2>&1 <<'PY'
import sys
import torch, transformers, qwen_tts  # noqa: F401
assert transformers.__version__ == "4.57.3" and "qwen3tts-ref" in transformers.__file__, transformers.__file__
assert "stubs" in sys.modules["torchaudio"].__file__ and "stubs" in sys.modules["onnxruntime"].__file__
assert "qwen3tts-ref" not in torch.__file__, torch.__file__
PY
) || { echo "$log"; echo "qwen3-tts golden: the reference packages do not shadow the main venv's"; exit 1; }
}

mkdir -p "$OUT"
for script in tests/reference/qwen3_tts*_golden.py; do
    name=$(basename "$script" .py)
    key=$(cat "$script" | sha256sum | cut -c1-16)-$stamp
    [ "$(cat "$OUT/$name/.stamp" 2>/dev/null)" = "$key" ] && continue
    [ -n "${checked:-}" ] || { check_shadowing; checked=1; }
    rm -rf "$OUT/$name.new" && mkdir -p "$OUT/$name.new"
    python "$script" "$OUT/$name.new" > "$OUT/$name.log" 2>&1 || { cat "$OUT/$name.log"; exit 1; }
    echo "$key" > "$OUT/$name.new/.stamp"
    rm -rf "${OUT:?}/$name" && mv "$OUT/$name.new" "$OUT/$name"
    echo "qwen3-tts golden: $OUT/$name"
done
