"""Integrations of cudaflash with other libraries; each module imports its library (an
optional dependency) and is imported only by the user: ``import cudaflash`` loads none of
them."""
