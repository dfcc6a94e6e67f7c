"""The test suite, laid out by stage like the package: compiler/, runtime/, api/,
end_to_end/, bench/; shared helpers in helpers/ (imported as tests.helpers.<module>)."""
