"""Pure-Python references the drafter's Lua scripts are held to, and Python faces of a single
script (one algorithm's store): used only by the tests."""
