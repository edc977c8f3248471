"""The data gate: Great Expectations over a manifest of the dataset in Blob storage.

``manifest`` lists the dataset and describes each image from one read, decoded whole as the
trainer decodes it, with a cache by content (Content-MD5 and size, or name and ETag);
``suites`` holds the expectations and runs them; ``verdicts`` keeps their verdict by what
decided it, so an unchanged manifest under unchanged rules is not judged twice; ``report`` says
what failed, naming the files.
A failed gate stops the run before anything is provisioned. Great Expectations and pandas are
imported only when the suites run.
"""
