"""Make the sampled completions visible (--log-completions, TRL's `log_completions`): <out>/completions.jsonl, a
table per iteration on the trackers, and the first few in the log.

    <out>/completions.jsonl   one JSON object per completion, iteration after iteration, each in prompt order:
        {"iteration": k, "group": j, "sample": i, "prompt": x_j as the model saw it (chat template, special tokens),
         "completion": o_ji decoded as the rewards read it (special tokens skipped), "rewards": {name: r_k(x_j, o_ji)},
         "reward": Σ_k w_k r_k, "advantage": A_ji as trained}

`k` is the iteration (the weights θ_k that sampled it), `j` the prompt's index in the iteration (learner.py's group
index), `i` the response's index in its group; a reward that scored nothing is null (NaN in the run). A_ji is the
advantage the learner trained on (learner.Learner.taken): with --scale-rewards batch the centred reward divided by
std(r_batch) + eps, known once the iteration's last group is in, as it is when the lines are written. Per iteration,
"reward" averages (over the non-null) to the row's reward and "rewards"[name] to its rewards/<name>/mean
(metrics.jsonl), and the advantages of a group sum to 0 (grpo.group_advantages).

Who writes: the trainer process, as soon as the loop yields the iteration's metrics row, before that row is written and
its log line printed (launch/setup.py: so a checkpoint never holds an iteration whose completions are missing). Under
torchrun each trainer rank holds only its own groups: `gathered` unites every rank's (a collective, as learner.metrics
gathers the rewards) and rank 0 alone writes. The file follows metrics.jsonl's discipline (launch/run_output.py): an
iteration's lines are appended in one write, so a kill leaves whole lines but perhaps one torn last line, which readers
skip; a resumed run keeps the lines of the iterations before its checkpoint, rewritten atomically once its first
iteration is in hand, and drops the rest; --overwrite deletes the file (infra/outputs.py). The trackers get the same
records as a table named "completions" (TRL's: step, prompt, completion, each reward, advantage; here with the group,
the sample and the summed reward too): infra/tracking.py.

Departure from TRL: `num_completions_to_print` prints the first N of the iteration, in prompt order, not N drawn at
random (no random state is touched, so a logged run stays the run that was not), as plain lines, not a rich table; its
default 0 prints none (TRL's None prints all).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Callable

from infra import distributed, outputs
from infra.distributed import Ranks

COMPLETIONS = "completions.jsonl"  # in --out


def records(iteration: int, groups: dict, tokenizer, reward_names: list[str]) -> list[dict]:
    """One record per completion of `groups` (group index -> rollout.ScoredGroup: prompt ids, responses, rewards,
    advantages as trained), in index order, then sample order.

    Example: a group j=3 of G=2, one reward "math" of weight 1:
        -> [{"iteration": k, "group": 3, "sample": 0, "prompt": "2+2=", "completion": "4", "rewards": {"math": 1.0},
             "reward": 1.0, "advantage": 0.707}, {... "sample": 1, ... "advantage": -0.707}]
    """
    def number(value: float) -> float | None:
        return None if math.isnan(value) else value  # JSON has no NaN
    found = []
    for index in sorted(groups):
        group = groups[index]
        prompt = tokenizer.decode(group.prompt_ids, skip_special_tokens=False)
        texts = tokenizer.batch_decode(group.responses, skip_special_tokens=True)  # as rollout.score_responses
        for i, text in enumerate(texts):
            found.append({"iteration": iteration, "group": index, "sample": i, "prompt": prompt, "completion": text,
                          "rewards": {name: number(parts[i]) for name, parts in
                                      zip(reward_names, group.rewards_per_function)},
                          "reward": number(group.rewards[i]), "advantage": group.advantages[i],
                          **({"extra": {column: values[i] for column, values in group.extra.items()}}  # log_extra's
                             if group.extra else {})})
    return found


def gathered(iteration: int, groups: dict, tokenizer, reward_names: list[str], ranks: Ranks = Ranks()) -> list[dict]:
    """`records` of every trainer rank's groups (each rank decodes its own; a collective: every rank calls it)."""
    mine = records(iteration, groups, tokenizer, reward_names)
    if ranks.size == 1:
        return mine
    by_group: dict[int, list[dict]] = {}
    for record in mine:
        by_group.setdefault(record["group"], []).append(record)
    everyone = distributed.gather_dicts(by_group, ranks)  # group indices are disjoint across ranks
    return [record for index in sorted(everyone) for record in everyone[index]]


def read_lines(path: Path, before: int) -> list[str]:
    """The lines of a completions.jsonl whose iteration is before `before` (none if the file is missing; a line torn
    by a kill is dropped)."""
    kept = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("iteration"), int) and record["iteration"] < before:
            kept.append(line + "\n")
    return kept


def shown(record: dict, width: int = 100) -> str:
    """One log line for a completion: where it is, its rewards, its advantage, the end of its prompt, the completion."""
    def clipped(text: str) -> str:
        text = json.dumps(text, ensure_ascii=False)
        return text if len(text) <= width else "…" + text[-width:]
    rewards = ", ".join(f"{name} {value}" for name, value in record["rewards"].items())
    return (f"  iter {record['iteration']} group {record['group']} sample {record['sample']}  "
            f"reward {record['reward']} ({rewards})  advantage {record['advantage']:+.3f}  "
            f"prompt {clipped(record['prompt'])}  completion {json.dumps(record['completion'], ensure_ascii=False)}")


class CompletionsLog:
    """Rank 0's writer: `write(records)` per iteration appends them to <out>/completions.jsonl, sends them to the
    trackers (`report(records, step)`, infra/tracking.Trackers.log_completions) and prints the first `to_print`
    (`say`). A resumed run (`resumed_at` = k > 0) continues `history`, the completions.jsonl of the run it resumes."""

    def __init__(self, out: Path, resumed_at: int = 0, history: Path | None = None,
                 report: Callable[[list[dict], int], None] = lambda records, step: None, to_print: int = 0,
                 say: Callable[[str], None] = print):
        self.path, self.report, self.to_print, self.say = Path(out) / COMPLETIONS, report, to_print, say
        self.history, self.resumed_at = history, resumed_at
        self.continued = False  # whether the file is this run's (the kept lines written in place of its own)

    def write(self, found: list[dict]) -> None:
        if not found:
            return
        with outputs.writing("completions to", self.path):
            if not self.continued:  # atomically: a resume that fails before this leaves the file as it was
                kept = read_lines(self.history, self.resumed_at) if self.history and self.resumed_at else []
                outputs.write_atomically(self.path, "".join(kept))
                self.continued = True
            text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in found).encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                while text:  # one write() per iteration unless the file system takes less
                    text = text[os.write(fd, text):]
            finally:
                os.close(fd)
        self.report(found, found[0]["iteration"])
        for record in found[:self.to_print]:
            self.say(shown(record))
