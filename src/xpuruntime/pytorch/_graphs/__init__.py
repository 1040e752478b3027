"""CUDA graphs: capture and replay (:mod:`.capture`), and decoder layers replayed from
graphs of their forward and backward in plain training loops (:mod:`.layers`)."""
