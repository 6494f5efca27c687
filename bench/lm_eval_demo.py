"""lm-evaluation-harness against `smoe serve`, beside mlx-lm running the same weights.

    python bench/lm_eval_demo.py [VAULT] --lm-eval PYTHON [--docs 24] [--batch 8]

PYTHON: an interpreter that has lm-eval (its own environment: lm-eval 0.4 pulls datasets,
evaluate and the like; its API models need no torch, only transformers for the tokenizer):
`python -m venv /tmp/lm-eval && /tmp/lm-eval/bin/pip install "lm-eval[api]" transformers`.

Serves VAULT (default: the demo model, built if missing) in-process on a free port and
writes two tiny local lm-eval tasks from tests/data/kjv_held_out.txt (King James text the
demo never trained on), one clause a document:

- kjv_choice (multiple_choice, i.e. loglikelihood requests): the clause's first half; its
  own second half among four (three from other clauses). Metrics acc, acc_norm.
- kjv_continue (generate_until): the clause but its last two words, continued greedily up
  to 24 tokens or ``.``, ``;`` or ``:``. Metric exact_match (case, punctuation and outer
  spaces ignored) against those two words.

lm-eval runs its `local-completions` model on both (token-id prompts; a loglikelihood
batch is one request of ``--batch`` prompts with ``echo``, ``logprobs`` 1 and
``max_tokens`` 1) and `local-chat-completions` (``--apply_chat_template``) on
kjv_continue, with ``--log_samples``. Then the same requests, rebuilt from lm-eval's logged
samples and its tokenization (transformers, the vault's tokenizer), run on mlx-lm in
memory (the vault exported and loaded by mlx-lm, float weights cast to float32 as the
engine computes, tests/exact's ``reference_model``), in the engine's schedule (the prompt
but its last token prefilled in chunks of 64, then one token a step): each continuation's
log-likelihood and is-greedy from the float32 log-softmax, each greedy reply (to EOS or
the token limit, cut at the first stop string). Prints JSON: each task's scores by
lm-eval through the server and by the same metric on mlx-lm's values, and how many
per-request values (log-likelihoods, is-greedy, replies) are equal, bit for bit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import numpy as np

import smoe.util.loop
from smoe.engine import Engine
from smoe.serve.app import ServerOptions, serve

HELD_OUT = Path(__file__).parents[1] / "tests" / "data" / "kjv_held_out.txt"
CHUNK = 64  # the engine's default prefill chunk (the reference keeps its schedule)
# (lm-eval's completions add the EOS text: 4 in all, OpenAI's limit, which the server keeps)
STOPS = [".", ";", ":"]
GEN_TOKENS = 24


def clauses(n: int) -> list[list[str]]:
    """Up to ``n`` of the held-out text's clauses of 8+ words, as words."""
    text = " ".join(HELD_OUT.read_text(encoding="utf-8").split())
    out = [c.rstrip(".;:").split() for c in re.split(r"(?<=[.;:])\s+", text)]
    return [words for words in out if len(words) >= 8][:n]


def write_tasks(folder: Path, docs: list[list[str]]) -> None:
    """The two tasks' data (JSON lines) and configs (lm-eval YAML) in ``folder``."""
    rng = random.Random(0)
    halves = [(" ".join(w[: len(w) // 2]), " ".join(w[len(w) // 2 :])) for w in docs]
    with open(folder / "choice.jsonl", "w") as f:
        for i, (context, answer) in enumerate(halves):
            others = rng.sample([a for j, (_, a) in enumerate(halves) if j != i], 3)
            gold = rng.randrange(4)
            choices = others[:gold] + [answer] + others[gold:]
            f.write(json.dumps({"context": context, "choices": choices, "gold": gold}) + "\n")
    with open(folder / "continue.jsonl", "w") as f:
        for words in docs:
            doc = {"context": " ".join(words[:-2]), "answer": " ".join(words[-2:])}
            f.write(json.dumps(doc) + "\n")
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: context\n"
    (folder / "kjv_choice.yaml").write_text(
        f"task: kjv_choice\n{common}"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (folder / "kjv_continue.yaml").write_text(
        f"task: kjv_continue\n{common}"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'continue.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: answer\n"
        f"generation_kwargs:\n  until: {json.dumps(STOPS)}\n"
        f"  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n"
        '    ignore_punctuation: true\n    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]\n'
    )


async def lm_eval(
    python: str, folder: Path, out: Path, model: str, args: str, tasks: str, batch: int = 1
) -> None:
    """Run lm-eval (a subprocess: this loop keeps serving) with samples logged to ``out``."""
    cmd = [python, "-m", "lm_eval", "--model", model, "--model_args", args]
    cmd += ["--tasks", tasks, "--include_path", str(folder), "--output_path", str(out)]
    cmd += ["--log_samples", "--seed", "1234", "--batch_size", str(batch)]
    if model == "local-chat-completions":
        cmd.append("--apply_chat_template")
    env = dict(
        os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    env["HF_HOME"] = str(folder / "hf")
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    log, _ = await proc.communicate()
    if proc.returncode:
        sys.stderr.write(log.decode(errors="replace")[-4000:])
        raise SystemExit(f"lm-eval failed ({model}): exit {proc.returncode}")


def arguments(sample: dict[str, Any]) -> list[list[Any]]:
    """A logged sample's requests' arguments (lm-eval writes {"gen_args_i": {"arg_j"}})."""
    return [list(args.values()) for args in sample["arguments"].values()]


def results(out: Path) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """lm-eval's scores per task, and its logged samples per task."""
    scores = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.split("_", 1)[1].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return scores, samples


# ----------------------------------------------------------------- mlx-lm in memory
class Reference:
    """mlx-lm's model for the vault in memory, fed as the engine feeds it."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tok = model, tokenizer
        self.eos = {tokenizer.eos_token_id} - {None}

    def _prefill(self, ids: list[int]) -> tuple[Any, list[np.ndarray]]:
        """The cache after ids[:-1] in chunks, and each chunk's float32 log-softmax."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache, rows = make_prompt_cache(self.model), []
        head = ids[:-1]
        for start in range(0, len(head), CHUNK):
            y = self.model(mx.array(head[start : start + CHUNK])[None], cache=cache)[0]
            y = y.astype(mx.float32)
            rows.append(np.array(y - mx.logsumexp(y, axis=-1, keepdims=True)))
        return cache, rows

    def loglikelihood(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """lm-eval's (summed log-probability, is greedy) of ``continuation``."""
        ids = context + continuation
        _, chunks = self._prefill(ids)
        rows = np.concatenate(chunks) if chunks else np.zeros((0, 1), np.float32)
        numbers = [float(rows[i - 1, ids[i]]) for i in range(len(context), len(ids))]
        greedy = all(
            rows[i - 1, ids[i]] == rows[i - 1].max() for i in range(len(context), len(ids))
        )
        return sum(numbers), greedy

    def generate(self, ids: list[int], max_tokens: int, stops: list[str]) -> str:
        """The greedy reply's text, up to an EOS id or ``max_tokens``, cut at a stop."""
        import mlx.core as mx

        cache, _ = self._prefill(ids)
        tokens, out = list(ids), []
        for _ in range(max_tokens):
            logits = self.model(mx.array(tokens[-1:])[None], cache=cache)[:, -1, :]
            token = int(mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1).item())
            if token in self.eos:
                break
            out.append(token)
            tokens.append(token)
            text = self.tok.decode(out)
            if any(s in text for s in stops):
                break
        text = self.tok.decode(out)
        cut = min((text.index(s) for s in stops if s in text), default=len(text))
        return text[:cut]


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair for a causal model (no special tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation, context = context[-spaces:] + continuation, context[:-spaces]
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def exact_match(prediction: str, reference: str) -> bool:
    """lm-eval's exact_match with the task's options (regexes, case, punctuation)."""

    def norm(s: str) -> str:
        for pattern in (r"^\s+", r"\s+$"):
            s = re.sub(pattern, "", s)
        return s.lower().translate(str.maketrans("", "", string.punctuation))

    return norm(prediction) == norm(reference)


def check_choice(ref: Reference, tok: Any, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """mlx-lm's acc and acc_norm on kjv_choice, and agreement with the served values."""
    same_ll = same_greedy = total = acc = acc_norm = 0
    for s in samples:
        lls = []
        for (context, continuation), served in zip(arguments(s), s["resps"], strict=True):
            ll, greedy = ref.loglikelihood(*encode_pair(tok, context, continuation))
            lls.append(ll)
            total += 1  # (logged as text: repr of the float, "True"/"False")
            same_ll += ll == float(served[0][0])
            same_greedy += str(greedy) == served[0][1]
        choices = s["doc"]["choices"]
        gold = s["doc"]["gold"]
        acc += int(np.argmax(lls) == gold)
        lengths = np.array([float(len(c)) for c in choices])
        acc_norm += int(np.argmax(np.array(lls) / lengths) == gold)
    n = len(samples)
    return {
        "acc": acc / n,
        "acc_norm": acc_norm / n,
        "requests": total,
        "same_loglikelihood": same_ll,
        "same_is_greedy": same_greedy,
    }


def check_continue(
    ref: Reference, tok: Any, samples: list[dict[str, Any]], chat: bool
) -> dict[str, Any]:
    """mlx-lm's exact_match on kjv_continue, and how many replies equal the served ones."""
    same = em = 0
    for s in samples:
        context = arguments(s)[0][0]
        if chat:  # lm-eval's chat history, as JSON (in a one-field tuple, logged as a list)
            messages = json.loads(context[0] if isinstance(context, list) else context)
            ids = tok.apply_chat_template(messages, add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok(context, add_special_tokens=False).input_ids
        reply = ref.generate(ids, GEN_TOKENS, STOPS)
        served = s["resps"][0][0]
        same += reply == served
        em += exact_match(reply, s["target"])
    return {"exact_match": em / len(samples), "replies": len(samples), "same_reply": same}


async def main() -> None:
    p = harness.parser(__doc__)
    harness.vault(p, demo=True)
    p.add_argument("--lm-eval", required=True, metavar="PYTHON", help="python with lm-eval")
    p.add_argument("--docs", type=int, default=24, help="documents per task (default 24)")
    p.add_argument("--batch", type=int, default=8, help="lm-eval's batch_size (prompts a request)")
    args = p.parse_args()
    if args.vault is None:
        from smoe.chat.demo import demo_vault

        args.vault = str(demo_vault())
    from mlx_lm.utils import load_tokenizer
    from transformers import AutoTokenizer

    from smoe.vault.format import Vault
    from tests.exact.test_engine_exact import reference_model

    with tempfile.TemporaryDirectory(prefix="lm-eval-demo-") as tmp:
        root = Path(tmp)
        model = reference_model(Vault.open(args.vault), root / "mlx")  # (exports the folder)
        tok = AutoTokenizer.from_pretrained(root / "mlx")
        ref = Reference(model, load_tokenizer(root / "mlx"))
        docs = clauses(args.docs)
        write_tasks(root, docs)
        timings = {}
        async with Engine.open(args.vault) as engine:
            loop = asyncio.get_running_loop()
            port = loop.create_future()
            options = ServerOptions(prewarm_when_idle=False)
            task = loop.create_task(serve(engine, "127.0.0.1", 0, options, ready=port.set_result))
            base = f"http://127.0.0.1:{await port}/v1"
            completions = (
                f"model=smoe,base_url={base}/completions,tokenizer={root / 'mlx'},"
                f"tokenizer_backend=huggingface,max_retries=1"
            )
            chat = f"model=smoe,base_url={base}/chat/completions,max_retries=1"
            start = time.perf_counter()
            await lm_eval(
                args.lm_eval,
                root,
                root / "out-c",
                "local-completions",
                completions,
                "kjv_choice,kjv_continue",
                args.batch,
            )
            timings["local_completions_s"] = round(time.perf_counter() - start, 2)
            start = time.perf_counter()
            await lm_eval(
                args.lm_eval,
                root,
                root / "out-chat",
                "local-chat-completions",
                chat,
                "kjv_continue",
            )
            timings["local_chat_completions_s"] = round(time.perf_counter() - start, 2)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        scores, samples = results(root / "out-c")
        chat_scores, chat_samples = results(root / "out-chat")
        report = {
            "vault": str(args.vault),
            "docs": len(docs),
            "batch_size": args.batch,
            "kjv_choice": {
                "lm_eval_local_completions": _scores(scores["kjv_choice"]),
                "mlx_lm": check_choice(ref, tok, samples["kjv_choice"]),
            },
            "kjv_continue": {
                "lm_eval_local_completions": _scores(scores["kjv_continue"]),
                "mlx_lm_completions": check_continue(ref, tok, samples["kjv_continue"], False),
                "lm_eval_local_chat_completions": _scores(chat_scores["kjv_continue"]),
                "mlx_lm_chat": check_continue(ref, tok, chat_samples["kjv_continue"], True),
            },
            "seconds": timings,
        }
    harness.report(report, args)


def _scores(result: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's metric values (its "acc,none" keys, without the filter name)."""
    return {k.split(",")[0]: v for k, v in result.items() if "stderr" not in k and "," in k}


if __name__ == "__main__":
    smoe.util.loop.run(main())
