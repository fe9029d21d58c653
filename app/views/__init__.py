"""Dashboard pages, one module each; every module exposes `render(ctx)`."""
