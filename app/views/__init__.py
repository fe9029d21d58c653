"""Dashboard pages, one module each; every module exposes `TITLE` and `render(ctx)`."""
