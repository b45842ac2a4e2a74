"""The worker's prefix cache on and off, on a workload that shares a long system prompt.

Requests like an assistant's or an agent's: the same ~500-token system prompt (a policy
document and a JSON answer format), then each request's own question (numbered as a ticket, so no
two requests of a run share more than the system prompt); greedy, `--max-tokens`
new tokens, through the gateway's OpenAI-compatible API with streaming, constrained to a JSON
schema and not. c1: the 8 questions one after another; c8: all 8 at once; c8 cold: all 8 at
once under a system prompt no KV slot holds (a new desk number up front); a conversation: 4
turns, each repeating the exchange so far, 0.2 s of client work between them (turns 2-4
reported); 12 conversations at once, more than the batch has slots, one turn of each in turn
(turns 2-3 reported). Four `maskwire up` stacks (the defaults;
`--worker-arg=--prefix-refresh-tokens=0`, the cache without rewriting finished answers;
`--worker-arg=--prefix-cache-slots=0`, the cache in the batch's slots only;
`--worker-arg=--no-prefix-cache`) are up at once and measured in a rotating order per round, so
drifting load falls on all alike. Reports per figure the medians and the ratios of the defaults
over each other stack by round: TTFT, request time and,
from the usage chunks, the prompt tokens the cache held
(`usage.prompt_tokens_details.cached_tokens`).

Writes bench/results/<name>.json and, where matplotlib is installed, <name>.png. Never part of
CI: it needs a quiet machine.
Usage: python bench/prefix_cache.py [--rounds 4] [--max-tokens 32] [--name prefix_cache]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from neighbour import Server, chat_chunks, cpu_model, start_maskwire
from vs_vllm import cpu_features

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

POLICY = " ".join(
    f"Rule {i}: when a customer asks about {topic}, check the booking first, quote the tariff "
    f"sheet for {topic}, never guess a date, and say which office handles {topic}."
    for i, topic in enumerate(
        (
            "container sizes",
            "reefer cargo",
            "dangerous goods",
            "customs papers",
            "port fees",
            "demurrage",
            "insurance",
            "tracking",
            "delays",
            "claims",
            "invoices",
            "refunds",
        ),
        start=1,
    )
)
SYSTEM = (
    "You are the assistant of a shipping company that moves containers between Rotterdam, "
    f"Singapore and Los Angeles. {POLICY} Answer as JSON with the fields answer and office."
)
QUESTIONS = [
    "Can I ship lithium batteries to Singapore?",
    "How much is a 40-foot container to Los Angeles?",
    "My container is late, what do I do?",
    "Which papers do I need for customs in Rotterdam?",
    "Do you insure frozen fish?",
    "How do I track my booking?",
    "Who refunds a cancelled booking?",
    "What is demurrage?",
]
THINK_S = 0.2  # a client's time between an answer and its next turn
CUSTOMERS = 12  # conversations at once in `conversations`: more than the batch's 8 slots
# After a stack's workload: its idle work (rewriting the last answers into their slots) ends
# before the next stack is measured on the same cores.
SETTLE_S = 1.0

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 120}, "office": {"type": "string"}},
    "required": ["answer", "office"],
    "additionalProperties": False,
}


def ask(
    server: Server, question: str, constrained: bool, max_tokens: int, system: str = SYSTEM
) -> dict[str, float]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    figures, _ = chat(server, messages, constrained, max_tokens)
    return figures


def chat(
    server: Server, messages: list[dict[str, str]], constrained: bool, max_tokens: int
) -> tuple[dict[str, float], str]:
    """One streamed chat completion: its figures and its text."""
    body: dict[str, Any] = {
        "model": server.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        }
    began = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    text = ""
    for chunk in chat_chunks(server, body):
        choices = chunk.get("choices") or []
        content = choices[0].get("delta", {}).get("content") if choices else None
        if content:
            first = first or time.perf_counter()
            text += content
        usage = chunk.get("usage") or usage
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    figures = {
        "ttft_ms": 1e3 * ((first or end) - began),
        "request_ms": 1e3 * (end - began),
        "prompt_tokens": float(usage.get("prompt_tokens", 0)),
        "cached_tokens": float(details.get("cached_tokens", 0)),
    }
    return figures, text


def tickets(start: int) -> list[str]:
    """The questions, each as a new ticket: every request's own part is new to the cache."""
    return [f"Ticket {start + i}: {q}" for i, q in enumerate(QUESTIONS)]


def concurrently(
    server: Server, questions: list[str], constrained: bool, max_tokens: int, system: str = SYSTEM
) -> tuple[float, list[dict[str, float]]]:
    """All `questions` at once: the job's wall time (ms) and each request's figures."""
    began = time.perf_counter()
    with ThreadPoolExecutor(len(questions)) as pool:
        jobs = [pool.submit(ask, server, q, constrained, max_tokens, system) for q in questions]
        results = [job.result() for job in jobs]
    return 1e3 * (time.perf_counter() - began), results


def cached_share(results: list[dict[str, float]]) -> float:
    return sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results)


def conversation(server: Server, ticket: int) -> dict[str, float]:
    """A customer's conversation: 4 turns, each repeating the exchange so far (the previous
    answers included) and asking the next question, 64 new tokens each, after `THINK_S` of the
    client's own work (reading the answer, a tool call). Figures of turns 2-4."""
    messages = [{"role": "system", "content": SYSTEM}]
    later: list[dict[str, float]] = []
    for turn, question in enumerate(QUESTIONS[:4]):
        ask_more = f"Ticket {ticket}: {question} Explain step by step."  # a 64-token answer
        messages.append({"role": "user", "content": ask_more})
        figures, text = chat(server, messages, False, 64)
        messages.append({"role": "assistant", "content": text})
        if turn:
            later.append(figures)
        time.sleep(THINK_S)
    return {
        "turn_ttft_ms": statistics.median(r["ttft_ms"] for r in later),
        "turn_request_ms": statistics.median(r["request_ms"] for r in later),
        "turn_cached_share": cached_share(later),
    }


def conversations(server: Server, ticket: int) -> dict[str, float]:
    """`CUSTOMERS` conversations at once, more than the batch's 8 slots: one turn of each in
    turn (the others' turns come between two of one customer), 3 turns, 32 new tokens each,
    `THINK_S` apart. Figures of turns 2-3: whether a conversation's earlier turns are still held
    when its next one comes."""
    chats = [[{"role": "system", "content": SYSTEM}] for _ in range(CUSTOMERS)]
    later: list[dict[str, float]] = []
    for turn, question in enumerate(QUESTIONS[:3]):
        for customer, messages in enumerate(chats):
            messages.append({"role": "user", "content": f"Ticket {ticket + customer}: {question}"})
            figures, text = chat(server, messages, False, 32)
            messages.append({"role": "assistant", "content": text})
            if turn:
                later.append(figures)
            time.sleep(THINK_S)
    return {
        "many_turn_ttft_ms": statistics.median(r["ttft_ms"] for r in later),
        "many_turn_request_ms": statistics.median(r["request_ms"] for r in later),
        "many_turn_cached_share": cached_share(later),
    }


def workload(server: Server, max_tokens: int, ticket: int) -> dict[str, float]:
    """c8 on a system prompt no slot holds (cold), then c1 and c8 on the shared one,
    unconstrained and constrained, on tickets from `ticket` on."""
    out: dict[str, float] = {}
    for constrained in (False, True):
        kind = "constrained" if constrained else "unconstrained"
        # A new desk number up front: no slot holds any of this system prompt.
        cold_system = f"Desk {ticket}. {SYSTEM}"
        wall, cold = concurrently(server, tickets(ticket), constrained, max_tokens, cold_system)
        out[f"c8_cold_{kind}_wall_ms"] = wall
        out[f"c8_cold_{kind}_ttft_ms"] = statistics.median(r["ttft_ms"] for r in cold)
        out[f"c8_cold_{kind}_cached_share"] = cached_share(cold)
        ticket += len(QUESTIONS)
        questions = tickets(ticket)
        ticket += 2 * len(QUESTIONS)
        c1 = [ask(server, q, constrained, max_tokens) for q in questions]
        out[f"c1_{kind}_ttft_ms"] = statistics.median(r["ttft_ms"] for r in c1)
        out[f"c1_{kind}_request_ms"] = statistics.median(r["request_ms"] for r in c1)
        out[f"c1_{kind}_cached_share"] = cached_share(c1)
        wall, c8 = concurrently(server, tickets(ticket - len(QUESTIONS)), constrained, max_tokens)
        out[f"c8_{kind}_wall_ms"] = wall
        out[f"c8_{kind}_ttft_ms"] = statistics.median(r["ttft_ms"] for r in c8)
        out[f"c8_{kind}_cached_share"] = cached_share(c8)
    out.update(conversation(server, ticket))
    out.update(conversations(server, ticket + 1))
    time.sleep(SETTLE_S)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--name", default="prefix_cache")
    a = ap.parse_args()
    stacks = {
        "on": start_maskwire([], None),
        "no_refresh": start_maskwire(["--worker-arg=--prefix-refresh-tokens=0"], None),
        "batch_slots": start_maskwire(["--worker-arg=--prefix-cache-slots=0"], None),
        "off": start_maskwire(["--worker-arg=--no-prefix-cache"], None),
    }
    names = list(stacks)
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for server in stacks.values():  # warm-up: grammar compiles, first passes
            ask(server, QUESTIONS[0], True, 4)
        for i in range(a.rounds):
            order = names[i % len(names) :] + names[: i % len(names)]
            ticket = 1000 * (i + 1)  # every stack gets the same questions in a round
            rounds.append({v: workload(stacks[v], a.max_tokens, ticket) for v in order})
            print(f"round {i + 1}/{a.rounds}: {json.dumps(rounds[-1])}", flush=True)
    finally:
        for server in stacks.values():
            server.stop()
    keys = list(rounds[0]["on"])
    median = {v: {k: statistics.median(r[v][k] for r in rounds) for k in keys} for v in stacks}

    def ratios(base: str) -> dict[str, list[float]]:
        return {
            k: [r["on"][k] / r[base][k] for r in rounds if r[base][k]]
            for k in keys
            if "cached" not in k
        }

    ratio = ratios("off")
    out = {
        "median": median,
        "ratio_on_over_off": {k: statistics.median(v) for k, v in ratio.items()},
        "ratio_by_round": ratio,
        "ratio_on_over_no_refresh": {
            k: statistics.median(v) for k, v in ratios("no_refresh").items()
        },
        "ratio_on_over_batch_slots": {
            k: statistics.median(v) for k, v in ratios("batch_slots").items()
        },
        "rounds": rounds,
        "max_tokens": a.max_tokens,
        "load_avg": os.getloadavg(),
        "cpu": cpu_features(),
        "cpu_model": cpu_model(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    with contextlib.suppress(ImportError):
        plot(out, RESULTS / f"{a.name}.png")
    print(
        "| figure | cache on | no refresh | batch slots only | cache off | on / off "
        "| on / no refresh | on / batch slots only |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for k in keys:
        cells = [f"{median[v][k]:.2f}" for v in names]
        for table in ("ratio_on_over_off", "ratio_on_over_no_refresh", "ratio_on_over_batch_slots"):
            r = out[table].get(k)
            cells.append("" if r is None else f"{r:.2f}")
        print(f"| {k} | {' | '.join(cells)} |")


def plot(out: dict[str, Any], path: Path) -> None:
    """Each time figure's on / off ratio by round (dots) and their median (bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(out["ratio_on_over_off"])
    fig, ax = plt.subplots(figsize=(1.1 * len(keys) + 2, 4.5))
    ax.bar(range(len(keys)), [out["ratio_on_over_off"][k] for k in keys], color="#2a7fbf")
    for i, k in enumerate(keys):
        ax.plot([i] * len(out["ratio_by_round"][k]), out["ratio_by_round"][k], "o", color="#333")
    ax.axhline(1.0, color="#999999", lw=0.8)
    ax.set_xticks(range(len(keys)), keys, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("prefix cache on / off")
    fig.suptitle(f"{out['cpu_model']}, {len(out['rounds'])} rounds", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
