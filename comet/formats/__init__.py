"""The data formats the ops take, below the ops: they import nothing of comet but its compiled core
(comet._native), so the ops, their autograd and the tuner's profiling can all use them.

* :mod:`comet.formats.fp8` -- FP8 rows and blocks: the quantisers, their inverse and the packed
  rows FP8 tokens travel as. The public face is :mod:`comet.fp8`, which adds the master-weight
  wrappers (above the ops).
"""
