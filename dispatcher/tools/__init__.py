"""Tools beside the core: the doctor, the bench, install planning and Hub fetching (`python -m dispatcher ...`,
`python install.py`). The core never imports from here."""
