"""The bundled reference implementation: the system under test.

Nothing in this package imports from the rest of ``harness``. The harness drives it through
one small seam, defined in :mod:`harness.reference.train`:

* ``TrainConfig``: every knob of one arm (model config name and field overrides, EP degree,
  routing, chunking, ...).
* ``Trainer(config, event_sink=None, grad_sink=None, update_sink=None)``: built inside each rank
  process after ``torch.distributed`` is initialised (or with no process group: one process
  hosts every logical EP rank). Process ``p`` of ``P`` hosts logical ranks ``[p*E/P, (p+1)*E/P)``.
* ``Trainer.step(step) -> dict``: ``{"step", "loss", "grad_norm", "tokens", "step_time_s"}``;
  loss and grad norm are global and identical on every process.
* ``Trainer.graph_export``: for the traced chunkings, the scheduled graph's token-exchange
  launches and waits as plain data (``{"nodes": [...]}``, see
  ``chunking.checks.export_exchange_graph``); None otherwise.
* ``event_sink(logical_rank, event)``: called for every token-exchange launch and wait; a
  launch carries ``send_counts`` and ``recv_counts``, rows to and from each logical rank.
* ``grad_sink(logical_rank, step, {name: gradient})``: once gradients are final, before clipping.
* ``update_sink(logical_rank, step, RankUpdate)``: on that rank's thread after its optimizer
  step: its own view of the loss and grad norm, and its replicated and expert parameters.
* ``pipeline.PipelineConfig`` / ``pipeline.VersionedTrainer``: the same seam for the delayed,
  versioned pipeline (``step(batch)`` per tick, ``drain()`` at the end; records add ages,
  applied batches and correction statistics).
* ``pec.PECConfig`` / ``pec.PECTrainer(config, ..., pec_sink=None, batches=B)``: the token embedding
  as a PEC table; ``step(batch)`` for batches 1..B in order (the last one drains);
  ``pec_sink(logical_rank, event)`` gets its lookups, gradient all-to-all starts and applies.
"""
