"""The Streamlit dashboard's building blocks: selection state, cached store access, derived arrays, figures."""
