#!/bin/sh
echo "hello from an image built by kaniko via buildq"
