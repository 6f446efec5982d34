"""``disttrain bench``: one script, several process counts, one table.

:mod:`.bench` validates a bench and runs its counts in turn; :mod:`.runner` runs one count
through ``disttrain run`` and reads what it measured; :mod:`.report` is the pure part
(speed-up, efficiency, the recommendation, the table and JSON); :mod:`.plot` draws the
speed-up curve when matplotlib is installed.
"""
