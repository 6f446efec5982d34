"""``disttrain ui``: a local web page of every run and job, read from the run folders and the job store.

:mod:`.runs_list` reads the run folders for the list, :mod:`.run_page` one run folder for its page,
:mod:`.job_view` the job store and the tuning jobs; :mod:`.charts` draws the run page's plots as inline
SVG; :mod:`.server` is the web app (Starlette, Jinja2; served by uvicorn from ``disttrain.cli.ui``).
Nothing here writes: the page is a view of what the runs recorded.
"""
