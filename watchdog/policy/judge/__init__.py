"""The statistics behind a verdict, pure functions over numbers: the verdict type and combination
(``verdict``), paired and unpaired tests of one window (``paired``), pooled tests over several
windows (``pooled``), learned nulls for live metrics (``live``) and the distributions they use
(``stats``).
"""
