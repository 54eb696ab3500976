#!/usr/bin/env bash
# One command from a fresh clone: set up .venv, export the embedded SmolLM2-135M-Instruct to a bundle,
# add the shipped Chimera draft, validate both against torch, then stream a generation with plain
# greedy decoding and with Chimera speculative decoding (identical output), each with its tokens/s.
# Idempotent.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
BUNDLE="${BUNDLE:-bundles/smollm2}"
PROMPT="${PROMPT:-Explain in three sentences why the sky is blue.}"
if [ -f "$BUNDLE/manifest.json" ]; then
  echo "[main] bundle $BUNDLE exists; reusing it (delete it or run 'specdeploy export base --force' to redo)" >&2
else
  specdeploy export base --out "$BUNDLE"
fi
specdeploy export draft --kind chimera --draft graphs/weights/chimera.safetensors "$BUNDLE"
specdeploy validate "$BUNDLE"
echo "[main] plain greedy decoding:" >&2
specdeploy generate "$BUNDLE" --chat --prompt "$PROMPT" --max-new-tokens 128 --threads "${THREADS:-2}"
echo "[main] Chimera speculative decoding (identical output):" >&2
specdeploy generate "$BUNDLE" --chat --prompt "$PROMPT" --max-new-tokens 128 --threads "${THREADS:-2}" \
  --draft chimera
