"""The default cost model: a step's time as the sum of measured operator times.

`tables.py` finds and loads a folder of operator tables, `systems.py` reads the tables package's
own layout (its systems and vLLM versions), `derive.py` turns one system's tables into a model's
operator curves, `profile.py` stores them as one JSON profile, `interp.py` interpolates them (exact on
grid points), `model.py` sums them into a step's time and `backend.py` answers the engine with it.
"""
