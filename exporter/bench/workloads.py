"""Named prompt sets beyond MT-bench, written as JSONL for ``specdeploy bench --prompts``.

``json-template``: one repetitive multi-user workload, many requests that fill the same JSON-extraction
template with different records (names, ages, occupations, cities; deterministic), as a service that
many users call with one prompt template sees. Its answers share their structure, which is what a
draft cache shared across requests (``--draft suffix`` or ``auto``) can learn once.

    python -m specdeploy.exporter.bench.workloads json-template out/json_template.jsonl [--count 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

NAMES = ("Ann Berg", "Omar Haddad", "Li Wei", "Maria Rossi", "Kofi Mensah", "Sara Novak", "Diego Ruiz", "Yuki Sato",
         "Emma Dubois", "Arjun Rao", "Nina Petrova", "Lucas Silva", "Fatima Zahra", "Tom Walsh", "Ingrid Holm",
         "Chen Jie")
JOBS = ("nurse", "carpenter", "software engineer", "teacher", "baker", "pilot", "lawyer", "farmer", "chemist",
        "librarian", "electrician", "architect")
CITIES = ("Oslo", "Lisbon", "Nairobi", "Osaka", "Lima", "Krakow", "Toronto", "Cairo", "Melbourne", "Porto",
          "Seoul", "Denver")
TEMPLATE = ("Extract the person's details from the record below. Reply with JSON only, with the keys \"name\", "
            "\"age\", \"occupation\" and \"city\".\n\nRecord: {name} is a {age}-year-old {job} who lives in {city}.")
WORKLOADS = ("json-template",)


def json_template(count: int = 64, seed: int = 0) -> list[str]:
    """``count`` prompts of one template, each with its own record."""
    rng = np.random.default_rng(seed)
    return [TEMPLATE.format(name=NAMES[rng.integers(len(NAMES))], age=int(rng.integers(19, 80)),
                            job=JOBS[rng.integers(len(JOBS))], city=CITIES[rng.integers(len(CITIES))])
            for _ in range(count)]


def write(name: str, out: Path, count: int) -> Path:
    if name not in WORKLOADS:
        raise ValueError(f"Unknown workload '{name}'; choose one of {', '.join(WORKLOADS)}.")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in json_template(count)), encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", choices=WORKLOADS)
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=64)
    args = ap.parse_args(argv)
    print(f"wrote {write(args.name, args.out, args.count)} ({args.count} prompts)")


if __name__ == "__main__":
    main()
