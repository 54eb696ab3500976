import os

from specdeploy.runtime import load

bundle = os.environ.get("SPECDEPLOY_BUNDLE", "bundles/smollm2")
with load(bundle, draft="prompt-lookup") as engine:
    out = engine.generate("Name three prime numbers.", max_new_tokens=32, temperature=0.0)
    print(out.text)
    print(f"{out.stats.tokens_per_s:.1f} tok/s, tau {out.stats.mean_accepted:.2f}, {out.finish_reason}")
    chat = [{"role": "user", "content": "Write a haiku about CPUs."}]
    for delta in engine.stream(messages=chat, max_new_tokens=48, stop=["\n\n"]):
        print(delta, end="", flush=True)
    print()
