"""The harness every study is built on: typed setups (``setups``), processes and what they
measure (``measure``, ``workers``, ``throttle``, ``netns``, ``multihost``), paired rounds
(``paired``, ``paired_stats``), what the numbers are held against (``targets``, ``capacity``)
and the one report writer (``report``). Nothing here imports a study."""
