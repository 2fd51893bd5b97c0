"""Per model version statistics, as Triton's statistics extension reports them (KServe V2 extension:
`GET /v2/models[/NAME[/versions/V]]/stats`, gRPC ModelStatistics).

    VersionStatistics   one loaded version's counters (its batcher's `statistics`): fed by the
                        batcher per model run (engine thread) and by the inference path per request
                        (core.Server.answer); read by serving/extensions.py for both protocols

What each figure is here (Triton's meaning, mapped onto this server's path):
- inference_count: the rows of every successful model run (a request of 8 rows counts 8; padding
  none); execution_count: the successful model runs (a dynamic batch is one).
- success / fail: each inference request that reached a model version, with its time from its
  arrival (an HTTP request's head read, a gRPC message taken) until its answer was computed, or its
  refusal. Refusals before a version is chosen (an unknown model) belong to no version and are
  counted nowhere.
- queue: a request's wait from being queued on its version's batcher until the engine thread began
  its run.
- compute_input: assembling the run's rows on the engine thread (the turn taken to the run's start);
  compute_infer: the model run (gathering rows into the batch, padding, onnxruntime's run);
  compute_output: cutting each request's rows out of the outputs and handing them to its event loop.
  As in Triton, every request of a run is counted once with the run's whole duration of each phase.
  Decoding a request's tensors and encoding its answer happen on the front end, outside these phases
  (in Triton too): they are the part of `success` that perf_analyzer calls overhead.
- batch_stats: per run size (rows), the runs of that size and their three phases.
A shadow challenger's mirrored requests (serving/shadow.py) run on its batcher: they count in its
runs, rows and phases, not as requests (no client asked them). Figures start at zero when a version
is loaded (a reload starts them again, as in Triton).
"""

from __future__ import annotations

import threading
import time

PHASES = ("queue", "compute_input", "compute_infer", "compute_output")


class VersionStatistics:
    """One version's counters. A model run's figures are written by the engine thread alone (the
    only thread that runs a batcher's runs), with no lock; a request's end is written from any event
    loop, under a lock. Readers take a copy: figures read while a run is written may miss that run,
    never count it twice."""

    __slots__ = ("_lock", "success", "fail", "last_answer", "runs")

    def __init__(self):
        self._lock = threading.Lock()
        # [count, seconds] each
        self.success, self.fail = [0, 0.0], [0, 0.0]
        # time.perf_counter() of the last request answered
        self.last_answer = None
        # (rows, requests) of a run -> [runs, input s, infer s, output s, queue s of all its
        # requests]
        self.runs: dict[tuple[int, int], list] = {}

    def executed(
        self, rows: int, arrivals: list[float], taken: float, began: float, ran: float, done: float
    ) -> None:
        """(engine thread) A successful model run of `rows` rows for requests queued at
        time.monotonic() `arrivals`: the turn taken at `taken`, the run from `began` to `ran`, its
        answers handed out by `done` (monotonic seconds)."""
        requests = len(arrivals)
        key = (rows, requests)
        figures = self.runs.get(key)
        if figures is None:
            figures = self.runs[key] = [0, 0.0, 0.0, 0.0, 0.0]
        figures[0] += 1
        figures[1] += began - taken
        figures[2] += ran - began
        figures[3] += done - ran
        figures[4] += began * requests - sum(arrivals)

    def answered(self, ok: bool, since: float) -> None:
        """One request's end: answered (`ok`) or refused, `since` its arrival
        (time.perf_counter())."""
        now = time.perf_counter()
        counter = self.success if ok else self.fail
        with self._lock:
            counter[0] += 1
            counter[1] += now - since
        if ok:
            # (a plain store: the latest of two racing requests wins either way)
            self.last_answer = now

    def snapshot(self, name: str, version: str) -> dict:
        """The version's `model_stat` object of the extension (Triton's JSON field names)."""
        with self._lock:
            success, fail = list(self.success), list(self.fail)
        last_answer = self.last_answer
        last_inference = (
            0
            if last_answer is None
            else round((time.time() - (time.perf_counter() - last_answer)) * 1000)
        )
        runs = [(key, list(figures)) for key, figures in list(self.runs.items())]
        inference_count = execution_count = 0
        # phase -> [count, seconds] over requests; run size -> [runs, input s, infer s, output s]
        phases = {phase: [0, 0.0] for phase in PHASES}
        sizes: dict[int, list] = {}
        for (rows, requests), (count, input_s, infer_s, output_s, queue_s) in runs:
            inference_count += rows * count
            execution_count += count
            for phase, seconds in zip(
                PHASES, (queue_s, input_s * requests, infer_s * requests, output_s * requests)
            ):
                phases[phase][0] += requests * count
                phases[phase][1] += seconds
            size = sizes.setdefault(rows, [0, 0.0, 0.0, 0.0])
            size[0] += count
            size[1] += input_s
            size[2] += infer_s
            size[3] += output_s

        def duration(count: int, seconds: float) -> dict:
            return {"count": count, "ns": round(seconds * 1e9)}

        return {
            "name": name,
            "version": version,
            "last_inference": last_inference,
            "inference_count": inference_count,
            "execution_count": execution_count,
            "inference_stats": {
                "success": duration(*success),
                "fail": duration(*fail),
                **{phase: duration(*figure) for phase, figure in phases.items()},
                # no response cache here: never a hit or a miss
                "cache_hit": duration(0, 0.0),
                "cache_miss": duration(0, 0.0),
            },
            "response_stats": {},
            "batch_stats": [
                {
                    "batch_size": rows,
                    "compute_input": duration(count, input_s),
                    "compute_infer": duration(count, infer_s),
                    "compute_output": duration(count, output_s),
                }
                for rows, (count, input_s, infer_s, output_s) in sorted(sizes.items())
            ],
            "memory_usage": [],
        }
