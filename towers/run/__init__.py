"""The run: the ``Trainer`` and everything between it and one step.

``trainer`` (the public ``Trainer``) drives an ``executor`` (the interface
of where the towers are: ``local``, this process's towers, or
``towers.cluster``'s host actors on Ray for ``hosts`` > 1) through ``loop``
(segments of steps) with ``extensions`` (the loop's side concerns: logs,
checkpoints, evaluation, the summary) and ``profiling`` (the phase timer);
``resume`` is the policy of continuing a run from its checkpoint.  One step
itself is ``towers.step``'s.
"""
