"""The benchmark: cases, runners (ours and the peers), timing, report; ``run`` is the entry."""
