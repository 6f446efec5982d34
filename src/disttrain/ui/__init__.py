"""``disttrain ui``: a local web page of every run and job, read from the run folders and the job store.

:mod:`.run_view` reads a run folder, :mod:`.job_view` the job store and the tuning jobs, :mod:`.charts`
draws the run page's plots as inline SVG, :mod:`.server` is the web app (Starlette, Jinja2; served by
uvicorn from ``disttrain.cli.ui``). Nothing here writes: the page is a view of what the runs recorded.
"""
