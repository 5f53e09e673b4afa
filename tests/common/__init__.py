"""Tests of services/common (a package so its module names cannot collide with other services' tests)."""
