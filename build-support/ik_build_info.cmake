# Included into ik-llama-cpp-python's own CMake build (CMAKE_PROJECT_INCLUDE) when `make setup`
# compiles it for this CPU. Its 0.1.5 source distribution lacks the script that writes
# common/build-info.cpp (a build-number stub nothing in adaspec reads); without it the build
# stops. This writes a stand-in that fills the stub with fixed values.
set(_adaspec_ik_script "${CMAKE_SOURCE_DIR}/vendor/ik_llama.cpp/common/cmake/build-info-gen-cpp.cmake")
if(EXISTS "${CMAKE_SOURCE_DIR}/vendor/ik_llama.cpp/common/build-info.cpp.in"
   AND NOT EXISTS "${_adaspec_ik_script}")
  file(WRITE "${_adaspec_ik_script}" [=[
set(BUILD_NUMBER 0)
set(BUILD_COMMIT "sdist")
set(BUILD_COMPILER "${CMAKE_C_COMPILER_ID} ${CMAKE_C_COMPILER_VERSION}")
set(BUILD_TARGET "native")
configure_file("common/build-info.cpp.in" "common/build-info.cpp" @ONLY)
]=])
endif()
