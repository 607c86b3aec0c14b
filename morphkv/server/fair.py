"""Fair batching for ``morphkv serve``: a long prompt does not hold short requests hostage.

mlx_lm's ``BatchGenerator`` keeps one prefill batch: every prompt in it advances by up to
``prefill_step_size`` tokens per step, right-padded to the longest, and each step also runs a
decode step. A 2k-token prompt sent with four 64-token chats makes every chat pay for 2k
tokens of padded prefill, and a chat arriving during a long prefill waits for all of it
(``docs/serving.md``, "Fair batching").

``FairBatchGenerator`` is that class with three scheduling changes, nothing else (its prompt
and generation batches, caches, samplers and responses are mlx_lm's):

* **Groups by length.** Requests admitted together are sorted by prompt length and split into
  groups whose longest prompt is at most twice their shortest; each group is its own
  ``PromptProcessingBatch``, so a short prompt is never padded to a long one.
* **Pieces, shortest first.** Each step prefills ONE group by one piece (``--prefill-step-size``
  tokens per row): the group with the fewest prompt tokens left, or the oldest group once
  it was passed over twice in a row (a long prompt advances under a steady stream of short
  ones). A chat that arrives while a long prompt is being prefilled waits for one piece of it
  (two when the long one's turn comes first).
* **Prefill and decode share the time.** A step either prefills a piece or decodes one token
  for every running row, not both; after a piece that took ``t`` seconds while rows were
  decoding, the rows get ``t * (1 - share) / share`` seconds of decode steps before the next
  piece (``share`` 0.5: half the time each). Prompts that fit in one piece are not held back by
  that debt (their first tokens come sooner), but add to it; rows whose prompt was just
  prefilled decode their first token at the next step.

The scheduler is installed by rebinding the name ``BatchGenerator`` in ``mlx_lm.server`` (the
name its ``ResponseGenerator`` builds the generator through) while ``morphkv serve`` runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch

GROUP_RATIO = 2  # a group's longest prompt is at most this times its shortest
PASSED = 2  # the oldest group gets the next piece once passed over this many times in a row


@dataclass
class _Group:
    """Rows prefilled together: mlx_lm's prompt batch and, per row, [segments, done, total]."""

    batch: PromptProcessingBatch
    rows: list = field(default_factory=list)
    passed: int = 0  # pieces given to other groups in a row

    def left(self) -> int:
        return max(sum(len(s) for s in r[0]) for r in self.rows)


def group_lengths(lengths: list[int], ratio: float = GROUP_RATIO) -> list[list[int]]:
    """Indices of ``lengths`` in groups of similar length: sorted ascending, a new group
    starts where a length is over ``ratio`` times its group's first."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if groups and lengths[i] <= ratio * max(lengths[groups[-1][0]], 1):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class FairBatchGenerator(BatchGenerator):
    """mlx_lm's BatchGenerator with length groups, pieces and a prefill/decode time share."""

    share = 0.5  # the part of the time prefill gets while rows are decoding

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self._groups: list[_Group] = []
        self._owed = 0.0  # seconds of decode owed to running rows before the next piece

    # ---- where a uid is (mlx_lm's stage 1 is now a group and a row) -------------------------
    def _find_uids(self, uids):
        uids = set(uids)
        found = {}
        for i, uid in enumerate(self._generation_batch.uids):
            if uid in uids:
                found[uid] = (2, i)
        for g, group in enumerate(self._groups):
            for i, uid in enumerate(group.batch.uids):
                if uid in uids:
                    found[uid] = (1, (g, i))
        for i, seq in enumerate(self._unprocessed_sequences):
            if seq[0] in uids:
                found[seq[0]] = (0, i)
        return found

    def extract_cache(self, uids):
        results = {}
        for uid, (stage, idx) in self._find_uids(uids).items():
            if stage == 0:
                results[uid] = self._unprocessed_sequences[idx][3:5]
            elif stage == 1:
                batch = self._groups[idx[0]].batch
                results[uid] = (batch.extract_cache(idx[1]), batch.tokens[idx[1]])
            else:
                results[uid] = (self._generation_batch.extract_cache(idx),
                                self._generation_batch.tokens[idx])
        return results

    def remove(self, uids, return_prompt_caches=False):
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        found = self._find_uids(uids).values()
        gone = {stage: [idx for s, idx in found if s == stage] for stage in (0, 1, 2)}
        if gone[0]:
            self._unprocessed_sequences = type(self._unprocessed_sequences)(
                x for i, x in enumerate(self._unprocessed_sequences) if i not in gone[0])
        for g, group in enumerate(self._groups):
            drop = {i for gg, i in gone[1] if gg == g}
            if drop:
                keep = [i for i in range(len(group.rows)) if i not in drop]
                group.batch.filter(keep)
                group.rows = [group.rows[i] for i in keep]
        self._groups = [g for g in self._groups if g.rows]
        if gone[2]:
            keep = [i for i in range(len(self._generation_batch)) if i not in set(gone[2])]
            self._generation_batch.filter(keep)
        return caches

    @property
    def prompt_cache_nbytes(self):
        total = sum(c.nbytes for p in self._unprocessed_sequences for c in p[3])
        total += sum(c.nbytes for g in self._groups for c in g.batch.prompt_cache)
        return total + sum(c.nbytes for c in self._generation_batch.prompt_cache)

    # ---- scheduling -------------------------------------------------------------------------
    def _admit(self) -> None:
        prefilling = sum(len(g.rows) for g in self._groups)
        n = min(self.prefill_batch_size - prefilling,
                self.completion_batch_size - len(self._generation_batch) - prefilling,
                len(self._unprocessed_sequences))
        if n <= 0:
            return
        seqs = [self._unprocessed_sequences.popleft() for _ in range(n)]
        sizes = [sum(len(s) for s in seq[1]) for seq in seqs]
        for idx in group_lengths(sizes):
            chosen = [seqs[i] for i in idx]
            batch = PromptProcessingBatch(
                model=self.model, uids=[s[0] for s in chosen], caches=[s[3] for s in chosen],
                tokens=[s[4] for s in chosen], prefill_step_size=self.prefill_step_size,
                samplers=[s[5] for s in chosen], fallback_sampler=self.sampler,
                logits_processors=[s[6] for s in chosen], stop_sequences=[s[7] for s in chosen],
                max_tokens=[s[2] for s in chosen])
            rows = [[seqs[i][1], 0, sizes[i]] for i in idx]
            self._groups.append(_Group(batch, rows))

    def _start_generating(self) -> list:
        """Rows whose prompt is all in the cache but the last token move to generation."""
        responses = []
        for group in self._groups:
            done = [i for i, r in enumerate(group.rows) if len(r[0]) == 1 and len(r[0][0]) == 1]
            if not done:
                continue
            last = [group.rows[i][0][0] for i in done]
            progress = [(group.rows[i][2],) * 2 for i in done]
            if len(done) == len(group.rows):
                batch, group.rows = group.batch, []
            else:
                batch = group.batch.split(done)
                group.rows = [r for i, r in enumerate(group.rows) if i not in set(done)]
            generation = batch.generate(last)
            responses += [PromptProcessingBatch.Response(uid, p, True, True)
                          for uid, p in zip(generation.uids, progress, strict=True)]
            self._generation_batch.extend(generation)
        self._groups = [g for g in self._groups if g.rows]
        return responses

    def _prefill(self, group: _Group) -> list:
        """One piece of every row of ``group`` (mlx_lm's step, on this group only)."""
        prompts, responses = [], []
        for uid, row in zip(group.batch.uids, group.rows, strict=True):
            segments = row[0]
            n = min(len(segments[0]), self.prefill_step_size)
            prompts.append(segments[0][:n])
            segments[0] = segments[0][n:]
            end = not segments[0]
            if end:
                segments.pop(0)
            row[1] += n
            responses.append(PromptProcessingBatch.Response(uid, (row[1], row[2]), end, False))
        self._counters.prompt_tokens += sum(len(p) for p in prompts)
        tic = time.perf_counter()
        group.batch.prompt(prompts)
        self._counters.prompt_time += time.perf_counter() - tic
        return responses

    def _decode(self) -> list:
        tic = time.perf_counter()
        responses = self._generation_batch.next()
        dt = time.perf_counter() - tic
        self._owed -= dt
        self._counters.decode_time += dt
        self._counters.generation_tokens += len(responses)
        self._counters.generation_steps += 1
        idle = not (len(self._generation_batch) or self._groups or self._unprocessed_sequences)
        if idle or self._counters.generation_steps % 512 == 0:
            mx.clear_cache()  # idle: the allocator's cached buffers go back (RSS returns)
        return responses

    def _next(self):
        if len(self._generation_batch) < self.completion_batch_size:
            self._admit()
        prompt_responses = self._start_generating()
        decoding = len(self._generation_batch) > 0
        if not self._groups:
            self._owed = 0.0
            return prompt_responses, self._decode() if decoding else []
        # shortest first, but the oldest group once it was passed over PASSED times in a row:
        # under a steady stream of short prompts a long one still advances (no starvation)
        oldest = self._groups[0]
        group = oldest if oldest.passed >= PASSED else min(self._groups, key=_Group.left)
        one_piece = max(r[2] for r in group.rows) <= self.prefill_step_size + 1
        if decoding and (prompt_responses or (self._owed > 0 and not one_piece)):
            return prompt_responses, self._decode()  # rows that just started decode first
        for g in self._groups:
            g.passed = 0 if g is group else g.passed + 1
        tic = time.perf_counter()
        prompt_responses += self._prefill(group)
        if decoding:
            self._owed = max(self._owed, 0.0) + (time.perf_counter() - tic) * (
                1 - self.share) / self.share
        return prompt_responses, []


def install(server_module, enabled: bool = True):
    """Rebind ``BatchGenerator`` in mlx_lm's server module; returns a function that undoes it."""
    original = server_module.BatchGenerator
    if enabled:
        server_module.BatchGenerator = FairBatchGenerator

    def undo():
        server_module.BatchGenerator = original

    return undo
